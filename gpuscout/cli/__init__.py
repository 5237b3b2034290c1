"""The ``gpuscout`` command (typer) and all console rendering (rich tables, progress, colours).

May import every other gpuscout subpackage; nothing imports it except ``gpuscout.__main__``.
"""
