"""A holder in a process of its own: serves both chunks of the test corpus on the fabric
named by argv[1], prints its address, and serves until Ctrl-C (SIGINT), then exits 0."""

import sys

import numpy as np

import kvroute


def main() -> int:
    fabric, layers, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    c = kvroute.Corpus(layers=layers, chunk_tokens=tokens, chunks=2, seed=1)
    blocks = [c.chunk(0), c.chunk(1)]
    chunks = [
        kvroute.HeldChunk(0, layers, tokens, offset=0),
        kvroute.HeldChunk(1, layers, tokens, offset=blocks[0].size),
    ]
    with kvroute.Holder(kvroute.Fabric(fabric), np.concatenate(blocks), chunks) as holder:
        print(holder.addr, flush=True)
        try:
            holder.serve()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
