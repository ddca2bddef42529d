"""The `python` / `torchrun` shim of tests/helpers/command_server.py: send this command line, its environment,
working directory and standard streams to the server; exit with the command's code. Run with `python -S -E`
(no site, no torch: it starts in milliseconds)."""

import json
import os
import socket
import sys


def main() -> int:
    kind, argv = sys.argv[1], sys.argv[2:]
    request = json.dumps({"kind": kind, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(os.environ["DOC_COMMAND_SERVER"])
        payload = len(request).to_bytes(8, "big") + request
        sent = socket.send_fds(connection, [payload], [0, 1, 2])
        connection.sendall(payload[sent:])
        answer = b""
        while chunk := connection.recv(64):
            answer += chunk
    return int(answer) if answer.strip() else 1


if __name__ == "__main__":
    sys.exit(main())
