"""The sampled fingerprint's probe offsets, drawn by a generator spelled out here.

The offsets were first drawn with `np.random.default_rng([size, FGPF]).integers(...)`. NumPy
promises that stream only within a version, and a moved offset changes every sampled
fingerprint: every saved state over a large raw or Megatron file would refuse to resume after a
numpy upgrade. So the same stream is written out here (SeedSequence, PCG64 and the bounded
draws of numpy 1.17 to 2.x, in plain integers): today's offsets, whatever numpy is installed.
`tests/test_store.py` holds it equal to numpy's over many sizes.
"""

from __future__ import annotations

M32, M64, M128 = (1 << 32) - 1, (1 << 64) - 1, (1 << 128) - 1
_PCG_MULT = 0x2360ED051FC65DA44385DF649FCCF645
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715
_POOL = 4


def _words(values: list[int]) -> list[int]:
    """Each non-negative integer as its 32-bit words, least significant first (0 is one word)."""
    out = []
    for v in values:
        out.append(v & M32)
        while v := v >> 32:
            out.append(v & M32)
    return out


def _seed_pool(entropy: list[int]) -> list[int]:
    """numpy's `SeedSequence(entropy).pool`."""
    const = [_INIT_A]

    def hashmix(value: int) -> int:
        value = (value ^ const[0]) & M32
        const[0] = (const[0] * _MULT_A) & M32
        value = (value * const[0]) & M32
        return value ^ (value >> 16)

    def mix(x: int, y: int) -> int:
        r = (_MIX_L * x - _MIX_R * y) & M32
        return r ^ (r >> 16)

    words = _words(entropy)
    pool = [hashmix(words[i] if i < len(words) else 0) for i in range(_POOL)]
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(_POOL, len(words)):
        for dst in range(_POOL):
            pool[dst] = mix(pool[dst], hashmix(words[src]))
    return pool


def _state_words(pool: list[int], n64: int) -> list[int]:
    """numpy's `SeedSequence.generate_state(n64, np.uint64)`."""
    const, out32 = _INIT_B, []
    for i in range(2 * n64):
        v = pool[i % _POOL] ^ const
        const = (const * _MULT_B) & M32
        v = (v * const) & M32
        out32.append(v ^ (v >> 16))
    return [out32[2 * i] | (out32[2 * i + 1] << 32) for i in range(n64)]


class _PCG64:
    """numpy's `PCG64` bit generator (XSL-RR output over a 128-bit LCG), with its 32-bit buffer."""

    def __init__(self, entropy: list[int]):
        s = _state_words(_seed_pool(entropy), 4)
        self.inc = ((((s[2] << 64) | s[3]) << 1) | 1) & M128
        self.state = 0
        self._step()
        self.state = (self.state + ((s[0] << 64) | s[1])) & M128
        self._step()
        self.half: int | None = None

    def _step(self) -> None:
        self.state = (self.state * _PCG_MULT + self.inc) & M128

    def next64(self) -> int:
        self._step()
        rot = self.state >> 122
        x = ((self.state >> 64) ^ self.state) & M64
        return ((x >> rot) | (x << (64 - rot))) & M64

    def next32(self) -> int:
        if self.half is not None:
            out, self.half = self.half, None
            return out
        v = self.next64()
        self.half = v >> 32
        return v & M32


def _bounded(g: _PCG64, rng: int) -> int:
    """numpy's Lemire draw of an integer in [0, rng] (32-bit draws when `rng` fits 32 bits)."""
    bits, draw = (32, g.next32) if rng <= M32 else (64, g.next64)
    mask, excl = (1 << bits) - 1, rng + 1
    if rng == mask:
        return draw()
    m = draw() * excl
    if (m & mask) < excl:
        threshold = (mask - rng) % excl
        while (m & mask) < threshold:
            m = draw() * excl
    return m >> bits


def integers(entropy: list[int], high: int, count: int) -> list[int]:
    """`np.random.default_rng(entropy).integers(0, high, count, dtype=np.int64)`, as a list."""
    if high < 1:
        raise ValueError(f"high must be >= 1, not {high}")
    g = _PCG64(entropy)
    return [_bounded(g, high - 1) for _ in range(count)]
