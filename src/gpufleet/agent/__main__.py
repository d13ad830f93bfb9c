"""``python -m gpufleet.agent --spec-fd FD``: the agent process that ``gpufleet agent`` execs
into (:func:`gpufleet.agent.main.exec_agent`), with arguments read from the pipe ``FD``.

Exit status: 0 when stopped, 2 bad arguments, 3 another agent holds the state dir, 4 no
usable node certificate (PKI), 5 the object store cannot be written and read back or is not
the fleet's (registration refused); the message is one ``error:`` line on stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m gpufleet.agent")
    ap.add_argument("--spec-fd", type=int, required=True)
    ap.add_argument("--node-id", default="")  # shown by ps; the spec decides
    args = ap.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from gpufleet.agent.main import AgentAlreadyRunning, StoreRefused, run_from_spec
    from gpufleet.rpc.pki import PkiError

    try:
        run_from_spec(args.spec_fd)
    except AgentAlreadyRunning as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(3)
    except PkiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(4)
    except StoreRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(5)
    except ValueError as exc:  # e.g. a malformed --gpus spec
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
