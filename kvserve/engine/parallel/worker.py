"""A spawned tensor-parallel worker: `python -m kvserve.engine.parallel.worker`, with its rank
and rank 0's store in KVSERVE_TP_* (kvserve/engine/parallel/group.py `_spawn`)."""
from __future__ import annotations

import logging
import os
import sys

from kvserve.engine.parallel.group import exit_with_parent, join
from kvserve.engine.parallel.setup import serve


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="kvserve: %(message)s", stream=sys.stderr)
    exit_with_parent(int(os.environ["KVSERVE_TP_PARENT"]))
    group = join(int(os.environ["KVSERVE_TP_RANK"]), int(os.environ["KVSERVE_TP_WORLD_SIZE"]),
                 os.environ["KVSERVE_TP_DEVICE"], os.environ["KVSERVE_TP_ADDR"], int(os.environ["KVSERVE_TP_PORT"]))
    return serve(group)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # nothing to tear down that the OS does not: skip seconds of freeing the shard
