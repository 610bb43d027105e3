"""Shared pytest options: `--update-goldens` regenerates tests/golden/."""


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true", default=False,
                     help="rewrite tests/golden/ from the current compiler instead of comparing")
