"""`python -m streamgrok` runs the command line."""

from streamgrok.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
