"""`refitd version`."""

from __future__ import annotations

import argparse

from refitd import __version__


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def run(args: argparse.Namespace) -> int:
    del args
    print(__version__)
    return 0
