"""Processes of this machine as tests see them (Linux's /proc)."""

from __future__ import annotations

from pathlib import Path


def session_processes(sid: int) -> list[str]:
    """The live processes of session `sid` (a server started in a session of its own), as "pid command"."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Fields after the command's closing parenthesis: state, ppid, pgrp, session, ...
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(f"{entry.name} {command}")
    return found
