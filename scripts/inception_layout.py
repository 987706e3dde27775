"""FID's Inception network on this machine: images a second in channels-last against the contiguous layout
(what fid.inception chose from this), alternated, median of --repeats, and how far apart the features are.

    python scripts/inception_layout.py [--batch 250] [--repeats 3] [--device cpu] [--inception_weights PATH]
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from machinery import fid, group
from machinery.errors import UserError, reported  # noqa: E402

LAYOUTS = {"channels_last": torch.channels_last, "contiguous": torch.contiguous_format}


def main(argv=None):
    with reported():
        p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        p.add_argument("--batch", type=int, default=250, help="images per call (fid.py's default)")
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--device", default="cpu")
        p.add_argument("--inception_weights", default="")
        args = p.parse_args(argv)
        if not (1 <= args.batch <= 4096 and 1 <= args.repeats <= 100):
            raise UserError("--batch must lie in [1, 4096] and --repeats in [1, 100]")
        device = group.resolve_device(args.device)
        net = fid.inception(device, args.inception_weights)
        x = torch.randint(0, 256, (args.batch, 3, 32, 32), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0))
        rates, feats = {k: [] for k in LAYOUTS}, {}
        for _ in range(args.repeats):
            for name, layout in LAYOUTS.items():  # alternated: drift and neighbours fall on both alike
                net.to(memory_format=layout)
                t = time.perf_counter()
                feats[name], _ = fid.features(net, [x], device)
                rates[name].append(args.batch / (time.perf_counter() - t))
        for name, r in rates.items():
            print(f"{name:14s} {statistics.median(r):6.2f} img/s (median of {args.repeats}: "
                  + ", ".join(f"{v:.2f}" for v in r) + ")")
        ratio = statistics.median(rates["channels_last"]) / statistics.median(rates["contiguous"])
        gap = (feats["channels_last"] - feats["contiguous"]).abs().max().item()
        print(f"channels_last / contiguous: {ratio:.2f}x; largest feature difference {gap:.2e}")


if __name__ == "__main__":
    main()
