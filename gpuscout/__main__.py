"""``python -m gpuscout`` runs the command line."""

from gpuscout.cli.app import app

if __name__ == "__main__":
    app(prog_name="gpuscout")
