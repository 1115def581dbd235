"""The wire format both ends share: errors keep their class and message; the default train id is a digest."""

from __future__ import annotations

import pytest

from art_core import errors
from art_core.wire import ErrorBody, error_from_wire, train_id_for


@pytest.mark.parametrize("name", [n for n in errors.__all__ if n != "ArtError"])
def test_every_art_error_crosses_as_itself(name: str):
    raised = error_from_wire(ErrorBody(type=name, message=f"{name}: the value and the fix"))
    assert type(raised) is getattr(errors, name) and str(raised) == f"{name}: the value and the fix"


def test_other_errors_arrive_as_server_errors_naming_their_type():
    raised = error_from_wire(ErrorBody(type="RuntimeError", message="CUDA out of memory"))
    assert type(raised) is errors.ServerError
    assert str(raised) == "the server failed with RuntimeError: CUDA out of memory"
    # A name that is not one of ours is never looked up elsewhere (no arbitrary class from the wire).
    assert type(error_from_wire(ErrorBody(type="__class__", message="x"))) is errors.ServerError


def test_train_id_is_a_digest_of_what_is_trained():
    a = train_id_for("p", "m", b'{"g":1}', b"{}")
    assert a == train_id_for("p", "m", b'{"g":1}', b"{}") and len(a) == 32
    assert len({a, train_id_for("p", "m", b'{"g":2}', b"{}"), train_id_for("p", "n", b'{"g":1}', b"{}"),
                train_id_for("p", "m", b'{"g":1}', b'{"loss":"grpo"}'), train_id_for("pm", "", b'{"g":1}', b"{}")}) == 5
