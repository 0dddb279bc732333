"""Does this jaxlib know Programmatic Dependent Launch (PDL), and do our Pallas kernels get it?

    python -m benchmarks.pdl_probe [--dump DIR]

1. Scans the XLA shared objects of the installed jaxlib and CUDA plugin for XLA debug-option
   names that mention PDL (the flag's name is not in JAX's docs; XLA added PDL in 2026).
2. Compiles one small program with a Pallas kernel (the streaming GEMV) next to an XLA
   fusion, dumps XLA's output, and counts `griddepcontrol` instructions in the dumped PTX:
   whether XLA's own kernels and the Pallas (Triton custom call) kernels wait on their
   predecessor.
Prints one JSON line; the decode A/B with the flags found is done by the calling script.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys


def flag_names() -> dict:
    """XLA debug-option names containing 'pdl' found in the jaxlib / plugin binaries."""
    import jaxlib
    roots = [os.path.dirname(jaxlib.__file__)]
    try:
        import jax_plugins
        roots += list(jax_plugins.__path__)
    except ImportError:
        pass
    found: dict[str, list[str]] = {}
    pat = re.compile(rb"xla_gpu_[a-z0-9_]*pdl[a-z0-9_]*")
    for root in roots:
        for so in glob.glob(os.path.join(root, "**", "*.so*"), recursive=True):
            try:
                data = open(so, "rb").read()
            except OSError:
                continue
            names = sorted({m.decode() for m in pat.findall(data)})
            # Literal search plus a slice of context: a regex with bounded repeats on both
            # sides of the words backtracks at every position of a 350 MB library (minutes).
            texts = set()
            for word in (b"rogrammatic dependent", b"rogrammatic Dependent", b"griddepcontrol"):
                i = data.find(word)
                while i >= 0 and len(texts) < 12:
                    texts.add(data[max(0, i - 40):i + 60].decode("ascii", "replace"))
                    i = data.find(word, i + 1)
            if names or texts:
                found[os.path.relpath(so, root)] = names + sorted(texts)
    return found


def ptx_probe(dump: str) -> dict:
    import jax
    import jax.numpy as jnp
    from pallas_kernels.gemv_stream import gemv_stream

    w = jnp.ones((2048, 2048), jnp.bfloat16)
    x = jnp.ones((1, 2048), jnp.bfloat16)

    @jax.jit
    def f(x, w):
        y = gemv_stream(jnp.tanh(x), w)  # an XLA fusion, then the Pallas kernel
        return jnp.tanh(y) * 2.0

    f(x, w).block_until_ready()
    out = {}
    for p in sorted(glob.glob(os.path.join(dump, "*.ptx"))):
        text = open(p, errors="replace").read()
        out[os.path.basename(p)] = {
            "entries": len(re.findall(r"\.entry\s", text)),
            "griddepcontrol.wait": text.count("griddepcontrol.wait"),
            "griddepcontrol.launch_dependents": text.count("griddepcontrol.launch_dependents"),
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", default="/tmp/pdl_probe_dump")
    ap.add_argument("--no-ptx", action="store_true", help="only scan the binaries")
    ap.add_argument("--no-scan", action="store_true", help="only the PTX probe")
    args = ap.parse_args(argv)
    res = {"xla_flags": os.environ.get("XLA_FLAGS", ""),
           "binaries": {} if args.no_scan else flag_names()}
    if not args.no_ptx:
        # Before jax is imported (flag_names only imports jaxlib): XLA reads XLA_FLAGS once.
        os.environ["XLA_FLAGS"] = f"{res['xla_flags']} --xla_dump_to={args.dump}".strip()
        res["ptx"] = ptx_probe(args.dump)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
