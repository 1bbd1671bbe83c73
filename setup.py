"""Builds aioshmq's compiled ring core; without a C compiler the package installs pure."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
FORMAT = HERE / "aioshmq" / "ring" / "format.py"


class OptionalBuildExt(build_ext):
    """build_ext that writes the core's ``format.h`` from ``aioshmq/ring/format.py`` (the
    format is declared there alone), and leaves the pure core in place when the compiled
    one cannot be built."""

    def run(self) -> None:
        generated = Path(self.build_temp) / "aioshmq-format"
        generated.mkdir(parents=True, exist_ok=True)
        header = runpy.run_path(str(FORMAT))["c_header"]()
        target = generated / "format.h"
        if not target.exists() or target.read_text() != header:
            target.write_text(header)
        for ext in self.extensions:
            ext.include_dirs.insert(0, str(generated))
        try:
            super().run()
        except Exception as exc:  # no compiler at all, no Python headers, ...
            self._skip(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._skip(exc)

    def _skip(self, exc: Exception) -> None:
        if os.environ.get("AIOSHMQ_REQUIRE_CORE"):  # wheels and CI must not ship it pure
            raise exc
        print(
            f"aioshmq: the compiled core was not built ({exc}); the pure-Python core "
            "will run instead",
            file=sys.stderr,
        )


FLAGS = [
    "-std=gnu11",
    "-O2",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    "-Wno-missing-field-initializers",
    "-Wno-cast-function-type",
]

setup(
    ext_modules=[
        Extension(
            "aioshmq.ring.compiled",
            ["aioshmq/ring/compiled.c", "aioshmq/ring/plainpickle.c"],
            depends=["aioshmq/ring/plainpickle.h", "aioshmq/ring/format.py"],
            extra_compile_args=FLAGS,
        ),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
