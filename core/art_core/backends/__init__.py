"""Where training runs: ``LocalBackend`` (this process). A remote backend follows in a later release."""
