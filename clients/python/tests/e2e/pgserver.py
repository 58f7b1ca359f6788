"""A private Postgres server for a store the test restarts: initdb into a temporary directory
(as the ``postgres`` user when run as root), started with ``pg_ctl`` on a free port of
127.0.0.1, restarted with ``pg_ctl restart -m fast``, stopped and deleted at the end. The
relay's own Postgres (5432) is never touched."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

#: A role that logs in with a password (the others are trusted), for refused credentials.
PASSWORD_ROLE = "relay_copier"
PASSWORD = "the-right-password"


def _bindir() -> Path:
    explicit = os.environ.get("RELAY_CONSUMER_E2E_PG_BINDIR")
    if explicit:
        return Path(explicit)
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).parent
    raise RuntimeError("no initdb: set RELAY_CONSUMER_E2E_PG_BINDIR to PostgreSQL's bin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivatePostgres:
    def __init__(self) -> None:
        self.bindir = _bindir()
        self.root = Path(tempfile.mkdtemp(prefix="relay-consumer-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = _free_port()
        self._as_postgres = os.geteuid() == 0

    def _run(self, *args: str) -> str:
        command = [str(self.bindir / args[0]), *args[1:]]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}\n"
                f"{self.log.read_text(errors='replace')[-2000:] if self.log.exists() else ''}"
            )
        return done.stdout

    def dsn(self, database: str = "postgres", user: str = "postgres",
            password: str | None = None) -> str:
        auth = user if password is None else f"{user}:{password}"
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        if self._as_postgres:
            shutil.chown(self.root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust",
                  "--no-sync", "-E", "UTF8", "--locale=C")
        hba = self.data / "pg_hba.conf"
        hba.write_text(
            f"host all {PASSWORD_ROLE} 127.0.0.1/32 scram-sha-256\n"
            "host all all 127.0.0.1/32 trust\n"
            "local all all trust\n"
        )
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
            "-o", f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c max_connections=40",
            "start",
        )

    def restart(self) -> None:
        """``pg_ctl restart -m fast``: every connection terminated, the server down a moment."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                  "-m", "fast", "restart")

    def stop(self) -> None:
        """Stops the server (if it runs) and deletes its directory."""
        try:
            if (self.data / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "30", "-m", "immediate",
                          "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
