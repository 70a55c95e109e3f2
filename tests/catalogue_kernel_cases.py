"""The reliability catalogue's cases for the kernel library's cache: ``mirrorsd generate`` with the
default ``--kernels auto`` on the tiny fp32 export, its cache holding a damaged library. Handled: exit 0, the tokens
printed, and one line that says the library was damaged and what happened instead (rebuilt, or ONNX Runtime's
kernels). The cache and the compiler are the workspace's (tests/kernel_cache_damage.py), never the user's."""
from __future__ import annotations

from catalogue import Case, Run, Workspace
from catalogue_fixtures import GEN, at_most_one_info_line
from kernel_cache_damage import copying_compiler, damage

KERNEL_CASES: list[Case] = []


def _damaged_cache_run(how: str, compiler_works: bool):
    def setup(w: Workspace) -> Run:
        from mirrorsd.devices import kernels

        built = kernels.library().path  # the real build, which the stand-in compiler copies
        compiler = copying_compiler(w.root / "bin", built, works=compiler_works)
        damage(w.root / "cache", compiler, how, built)
        folder = w.copy("export", "export")
        argv = ["generate", "--model", "export", "--prompt", "Hello", *GEN]
        code = (f"import os, sys\nos.environ.update(MIRRORSD_CACHE={str(w.root / 'cache')!r}, CXX={str(compiler)!r})\n"
                f"from mirrorsd.apps.cli import main\nsys.exit(main({argv!r}))")
        return Run(["python", "-c", code], w.root, protect=[folder])
    return setup


for _id, _how, _works, _what, _says in [
    ("kernel-library-empty", "empty", True, "generate with a 0-byte kernel library in the cache", "rebuilt it"),
    ("kernel-library-garbage", "garbage", True, "generate with a garbage kernel library in the cache", "rebuilt it"),
    ("kernel-library-is-a-folder", "library-is-a-folder", True, "generate with a folder where the kernel library "
     "belongs", "rebuilt it"),
    ("kernel-entry-is-a-file", "entry-is-a-file", True, "generate with a file where the kernel library's folder "
     "belongs", "rebuilt it"),
    ("kernel-library-garbage-rebuild-fails", "garbage", False, "generate with a garbage kernel library and a "
     "compiler that fails", "ONNX Runtime's kernels run instead"),
]:
    KERNEL_CASES.append(Case(_id, "23.3", _what, _damaged_cache_run(_how, _works), exit="ok",
                             says=("damaged", _says), quiet=("Traceback",), check=at_most_one_info_line))
