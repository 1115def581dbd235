"""A synthetic mailbox: a few hundred seeded emails in SQLite with an FTS5 index, and questions about them.

Everything follows from the seed, so a run's mailbox and questions can be rebuilt exactly. Two kinds of
email fill the inbox:

- **fact emails**: a colleague tells the reader when or where an event is ("the offsite is on May 3",
  "the budget review will be in Room 4B"). Each (event, colleague) pair occurs at most once, so the
  question about it ("When is the offsite with Dana?") has its answer in exactly one email;
- **filler**: newsletters, lunch invitations and status notes, from the same colleagues and others, so
  that a careless search finds plenty of noise.

The same event recurs with other colleagues (on other dates), and each colleague writes about several
events, so the agent has to search on both to find the right email. ``Mailbox`` serves the two searches
the agent's tools need: ``search`` (FTS5, ranked by bm25) and ``read``.
"""

from __future__ import annotations

import datetime as dt
import random
import re
import sqlite3
import threading
from dataclasses import dataclass

__all__ = ["Email", "Mailbox", "Question"]

PEOPLE = ["Dana Lee", "Omar Haddad", "Priya Nair", "Lukas Brandt", "Mei Chen", "Tom Okafor", "Sara Lind",
          "Jonas Weber", "Ana Costa", "Ravi Menon", "Elena Rossi", "Kofi Mensah"]
EVENTS = ["offsite", "budget review", "design review", "team dinner", "product launch", "board meeting",
          "hiring panel", "training session", "client visit", "quarterly planning"]
PLACES = [f"Room {floor}{wing}" for floor in range(1, 7) for wing in "ABC"] + [
    "the Lisbon office", "the Berlin office", "the rooftop terrace", "the main auditorium", "Cafe Luma"]
MONTHS = ["May", "June", "July", "August", "September", "October", "November"]
FILLER = [
    ("Lunch today?", "Anyone up for lunch at noon? I was thinking of the noodle place."),
    ("Weekly status", "Status this week: the migration is on track, two bugs fixed, one still open."),
    ("Coffee machine", "The coffee machine on the third floor is broken again. Facilities are on it."),
    ("Slides", "I uploaded the slides from yesterday to the shared drive."),
    ("Quick question", "Do you have the login for the analytics dashboard? Mine expired."),
    ("Thanks!", "Thanks for the help with the report, it went out on time."),
    ("Parking", "Reminder that the north parking lot is closed for repairs this week."),
    ("Out of office", "I am out of office until Monday with limited access to email."),
]
NEWSLETTERS = [
    ("news@techdigest.test", "Tech Digest", "This week in tech", "Top stories: chips, clouds and a new phone."),
    ("hr@company.test", "People Team", "Benefits enrolment", "Open enrolment for benefits closes at the end of the month."),
    ("it@company.test", "IT Help Desk", "Password expiry", "Your password expires soon. Change it on the portal."),
]
_FIRST_SENT = dt.date(2026, 1, 5)  # the inbox covers January to April 2026; the events come later


@dataclass(frozen=True)
class Email:
    """One email; ``id`` is its SQLite rowid (1, 2, ...)."""

    id: int
    sender: str
    """``Name <address>``."""
    date: str
    """Sent, ``YYYY-MM-DD``."""
    subject: str
    body: str


@dataclass(frozen=True)
class Question:
    """A question whose answer sits in exactly one email."""

    text: str
    """E.g. ``When is the offsite with Dana?``."""
    answer: str
    """E.g. ``May 3``."""
    source_id: int
    """The email that holds the answer."""


def _address(name: str) -> str:
    return f"{name} <{name.split()[0].lower()}@company.test>"


def _fact(rng: random.Random, person: str, event: str, kind: str) -> tuple[str, str, str, str]:
    """One fact email (subject, body) and its question (text, answer)."""
    first = person.split()[0]
    title = event[0].upper() + event[1:]
    if kind == "when":
        answer = f"{rng.choice(MONTHS)} {rng.randint(1, 28)}"
        subject = rng.choice([f"{title} date", f"{title}", f"Save the date: {event}"])
        body = rng.choice([f"Hi, the {event} is on {answer}. Please put it in your calendar.",
                           f"Quick note: we moved the {event} to {answer}. See you there.",
                           f"The {event} is planned for {answer}. Let me know if that does not work."])
        question = f"When is the {event} with {first}?"
    else:
        answer = rng.choice(PLACES)
        subject = rng.choice([f"{title} location", f"{title}", f"Where we meet: {event}"])
        body = rng.choice([f"Hi, the {event} will be in {answer}. Bring your laptop.",
                           f"We booked {answer} for the {event}.",
                           f"The {event} takes place in {answer} this time."])
        question = f"Where is the {event} with {first}?"
    return subject, f"{body}\n{first}", question, answer


class Mailbox:
    """A seeded inbox in an in-memory SQLite database with an FTS5 index over sender, subject and body.

    Safe to query from several threads (LangGraph's ``ToolNode`` may run tools in a thread pool): one
    connection, one lock.

    Args:
        seed: everything (emails, dates, which pairs get a fact) follows from it.
        facts: fact emails, each the answer to one question; at most ``len(PEOPLE) * len(EVENTS)``.
        filler: other emails.
    """

    def __init__(self, *, seed: int = 0, facts: int = 100, filler: int = 200) -> None:
        if not 0 < facts <= len(PEOPLE) * len(EVENTS):
            raise ValueError(f"facts must be between 1 and {len(PEOPLE) * len(EVENTS)} (one per colleague and "
                             f"event), got {facts}")
        rng = random.Random(seed)
        pairs = rng.sample([(p, e) for p in PEOPLE for e in EVENTS], facts)
        drafts: list[tuple[str, str, str, tuple[str, str] | None]] = []  # sender, subject, body, (question, answer)
        for person, event in pairs:
            subject, body, question, answer = _fact(rng, person, event, rng.choice(["when", "where"]))
            drafts.append((_address(person), subject, body, (question, answer)))
        for _ in range(filler):
            if rng.random() < 0.25:
                address, name, subject, body = rng.choice(NEWSLETTERS)
                drafts.append((f"{name} <{address}>", subject, body, None))
            else:
                person = rng.choice(PEOPLE)
                subject, body = rng.choice(FILLER)
                drafts.append((_address(person), subject, f"{body}\n{person.split()[0]}", None))
        rng.shuffle(drafts)
        days = sorted(rng.randrange(115) for _ in drafts)  # the inbox is in date order, like a real one

        self._lock = threading.Lock()
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        self._db.execute("CREATE TABLE emails (id INTEGER PRIMARY KEY, sender TEXT, date TEXT, subject TEXT, "
                         "body TEXT)")
        # External-content FTS5 table: the text lives once, in `emails`; the index points at its rowids.
        self._db.execute("CREATE VIRTUAL TABLE emails_fts USING fts5(sender, subject, body, content='emails', "
                         "content_rowid='id')")
        self.questions: list[Question] = []
        for rowid, ((sender, subject, body, fact), day) in enumerate(zip(drafts, days), start=1):
            date = (_FIRST_SENT + dt.timedelta(days=day)).isoformat()
            self._db.execute("INSERT INTO emails VALUES (?, ?, ?, ?, ?)", (rowid, sender, date, subject, body))
            if fact is not None:
                self.questions.append(Question(fact[0], fact[1], rowid))
        self._db.execute("INSERT INTO emails_fts(emails_fts) VALUES ('rebuild')")
        self._db.commit()
        self.size = len(drafts)

    def search(self, keywords: str, *, sender: str | None = None, after: str | None = None,
               before: str | None = None, limit: int = 3) -> list[Email]:
        """The best matches for any of ``keywords`` (bm25 rank), optionally from ``sender`` (a part of the
        name or address) and sent on or after ``after`` / before ``before`` (``YYYY-MM-DD``).

        Raises:
            ValueError: no word in ``keywords``, or a date that is not ``YYYY-MM-DD``.
        """
        words = re.findall(r"\w+", keywords.lower())
        if not words:
            raise ValueError(f"keywords must contain at least one word, got {keywords!r}")
        for name, value in (("after", after), ("before", before)):
            if value is not None and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", value):
                raise ValueError(f"{name} must be a date like 2026-03-01, got {value!r}")
        # Each word quoted (so FTS5 syntax in the input is just text), any of them may match: a small model
        # adds stray words, and bm25 still ranks the emails that match most of them first.
        query = " OR ".join(f'"{w}"' for w in dict.fromkeys(words))
        sql = ("SELECT e.id, e.sender, e.date, e.subject, e.body FROM emails_fts JOIN emails e "
               "ON e.id = emails_fts.rowid WHERE emails_fts MATCH ?")
        args: list[object] = [query]
        if sender:
            sql += " AND e.sender LIKE ?"
            args.append(f"%{sender}%")
        if after:
            sql += " AND e.date >= ?"
            args.append(after)
        if before:
            sql += " AND e.date < ?"
            args.append(before)
        sql += " ORDER BY bm25(emails_fts), e.id LIMIT ?"
        args.append(limit)
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [Email(*row) for row in rows]

    def read(self, email_id: int) -> Email | None:
        """The email with this id, or None."""
        with self._lock:
            row = self._db.execute("SELECT id, sender, date, subject, body FROM emails WHERE id = ?",
                                   (email_id,)).fetchone()
        return Email(*row) if row else None

    def all(self) -> list[Email]:
        """Every email, by id."""
        with self._lock:
            rows = self._db.execute("SELECT id, sender, date, subject, body FROM emails ORDER BY id").fetchall()
        return [Email(*row) for row in rows]
