"""How a benchmark command ends: exit 2 with one `error:` line for bad input, 130 when interrupted, 1 with
one `failed:` line naming what is missing when a run finished without every figure, 1 with the traceback
and where to look for anything else (docs/contracts.md's exit codes)."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from typing import Any

from eagle_pipeline.errors import BadInput


class IncompleteFigures(Exception):
    """The command ran to its end, but a figure it exists to measure is missing; the message names each."""


def run_command(run: Callable[[argparse.Namespace], Any], args: argparse.Namespace, *, interrupted: str,
                logs: str) -> int:
    try:
        run(args)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except IncompleteFigures as e:
        print(f"failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: {interrupted}", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - any other failure: exit 1 with where to look
        traceback.print_exc()
        print(f"failed: {type(e).__name__}: {e}; {logs}", file=sys.stderr)
        return 1
    return 0
