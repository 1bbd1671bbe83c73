"""Builds aioshmq's compiled ring core; without a C compiler the package installs pure."""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that leaves the pure core in place when the C core cannot be built."""

    def run(self) -> None:
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
            depends=["aioshmq/ring/plainpickle.h"],
            extra_compile_args=FLAGS,
        ),
        Extension("aioshmq.ends._cancel_c", ["aioshmq/ends/_cancel_c.c"], extra_compile_args=FLAGS),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
