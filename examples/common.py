"""What the example trainers share: the options every one of them takes,
and starting JAX and jaxring with them."""

from __future__ import annotations

import argparse

MODES = ("overlap", "allreduce", "psum")


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser described by the first paragraph of doc, with the
    options every example takes."""
    p = argparse.ArgumentParser(description=" ".join(doc.split("\n\n")[0].split()))
    p.add_argument("--mode", choices=MODES, default="overlap",
                   help="overlap: @jaxring.overlap; allreduce: jaxring.pmean; "
                        "psum: jax.lax.pmean")
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--link", default=None, help='emulated link, e.g. "1Gbit,50us"')
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def start(args):
    """Asks JAX for the virtual devices (before it starts its backend),
    checks that the global batch divides among them, turns on the link
    emulation, and returns the jaxring module."""
    import jaxring
    jaxring.use_cpu_devices(args.devices)
    if args.batch % args.devices:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --devices {args.devices}")
    if args.link:
        jaxring.config.update("cpu_link", args.link)
    return jaxring
