"""``python -m mirrorsd.devices.kernels``: build the kernel library now (scripts/setup.sh does) and say what runs.

Exits 0 when the library cannot be used here (no compiler, unsupported CPU): the runtime then uses ONNX Runtime's
kernels, and the message says why. Exits 1 when a compiler is present but the build fails.
"""
from __future__ import annotations

import sys

from mirrorsd.errors import KernelsUnavailableError
from mirrorsd.devices.kernels import library, superblocks, unavailable_reason
from mirrorsd.devices.kernels.build import find_compiler


def main() -> int:
    try:
        built = library()
    except KernelsUnavailableError as exc:
        print(f"mirrorsd kernels: not built. {exc}")
        return 1 if find_compiler() is not None else 0
    paths = ", ".join(f"{name}{'' if runs else ' (not on this CPU)'}" for name, runs in built.paths.items())
    print(f"mirrorsd kernels: {built.path} [{paths}]")
    reason = unavailable_reason()
    print(f"mirrorsd kernels: {reason or f'sessions use the {built.fast_path} path'}")
    if not reason:
        print("mirrorsd kernels: carried Q4_K weights in super-blocks (4.75 bits per weight, the same results): "
              + ("yes" if superblocks.in_use(built) else
                 f"no ({superblocks.ENV}=0, or a path without the layout; it has {', '.join(superblocks.PATHS)})"))
    return 0


if __name__ == "__main__":
    from mirrorsd.cli_exit import run_command

    sys.exit(run_command(main))  # `| head -1` ends it quietly, as every mirrorsd command
