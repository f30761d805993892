"""`make compose-test`: the compose deployment built and run with podman, checked end to end
(``python -m loadtests.compose``; see __main__.py). Not collected by pytest: not under tests/."""
