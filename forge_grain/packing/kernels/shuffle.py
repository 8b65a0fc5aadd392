"""Index shuffles: splitmix64-keyed Fisher-Yates for small epochs, a Feistel network for large
ones, each with its inverse (a row's position in its epoch), all closed forms of the index."""

from __future__ import annotations

import numba as nb
import numpy as np

from forge_grain.packing.kernels.cache import CACHE

@nb.njit(cache=CACHE, inline="always")
def _mix64(x):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@nb.njit(cache=CACHE, inline="always")
def _feistel_halves(n):
    """(bits per half, mask of a half) of the Feistel network over the smallest even bit
    width covering n."""
    bits = 2
    while (np.uint64(1) << np.uint64(bits)) < np.uint64(n):
        bits += 2
    half = np.uint64(bits // 2)
    return half, (np.uint64(1) << half) - np.uint64(1)


@nb.njit(cache=CACHE, inline="always")
def _feistel(x, n, half, mask, k):
    while True:
        left = x >> half
        right = x & mask
        for rnd in range(4):
            f = _mix64(right ^ (k + np.uint64(rnd) * np.uint64(0x9E3779B97F4A7C15))) & mask
            left, right = right, left ^ f
        x = (left << half) | right
        if x < n:
            return x


@nb.njit(cache=CACHE)
def permutation(n, key):
    """A random permutation of [0, n) determined by a 64-bit `key`: Fisher-Yates driven by
    splitmix64. The stream is this project's own, so a numpy upgrade cannot change the data
    (numpy does not promise to keep its Generator streams). The modulo's bias is below
    n / 2^64 per draw."""
    out = np.arange(n)
    state = np.uint64(key)
    for i in range(n - 1, 0, -1):
        state += np.uint64(0x9E3779B97F4A7C15)
        j = np.int64(_mix64(state) % np.uint64(i + 1))
        out[i], out[j] = out[j], out[i]
    return out


EXACT_SHUFFLE_MAX = 4096  # epochs of at most this many rows are shuffled exactly (Fisher-Yates)


@nb.njit(cache=CACHE, inline="always")
def _epoch_key(seed_key, e):
    return _mix64(np.uint64(seed_key) ^ _mix64(np.uint64(e) + np.uint64(0x632BE59BD9B4E019)))


@nb.njit(cache=CACHE, nogil=True)
def epoch_permutation(n, seed_key, e):
    """pi_e of `epoch_rows` for n up to `EXACT_SHUFFLE_MAX` (the Fisher-Yates shuffle it
    builds on every call), for a caller that reads many batches of one small epoch."""
    return permutation(n, _epoch_key(seed_key, e))


@nb.njit(cache=CACHE, nogil=True)
def epoch_rows(idx, n, seed_key, shuffle):
    """Plan rows of dataset indices: index i is row pi_e(i mod n) of epoch e = i // n, where
    pi_e is a seeded permutation of [0, n) whose key mixes `seed_key` with the epoch.

    Up to `EXACT_SHUFFLE_MAX` rows, pi_e is a Fisher-Yates shuffle (uniform, as an ideal
    shuffle is: a small Feistel network is far from it), built once per epoch a call
    touches, so its cost per index stays bounded. Beyond, pi_e is a 4-round Feistel network
    over the smallest even bit width covering n, with cycle walking to stay below n (as
    Grain's index_shuffle and MosaicML's shuffles do): O(1) memory and time per index.
    """
    out = np.empty(len(idx), np.int64)
    if not shuffle:
        for i in range(len(idx)):
            out[i] = idx[i] - (idx[i] // n) * n
        return out
    if n <= EXACT_SHUFFLE_MAX:
        perm = np.empty(0, np.int64)
        last = np.int64(-1)
        for i in range(len(idx)):
            e = idx[i] // n
            if e != last:
                perm = permutation(n, _epoch_key(seed_key, e))
                last = e
            out[i] = perm[idx[i] - e * n]
        return out
    half, mask = _feistel_halves(n)
    un = np.uint64(n)
    for i in range(len(idx)):
        e = idx[i] // n
        j = idx[i] - e * n
        out[i] = np.int64(_feistel(np.uint64(j), un, half, mask, _epoch_key(seed_key, e)))
    return out


@nb.njit(cache=CACHE, nogil=True)
def window_rows(local, m, key, perm, cum, first):
    """Plan rows of positions `local` among a window's m rows (`WindowOrder`): shuffled as
    `epoch_rows` shuffles epoch 0 of m rows under `key` (by `perm`, that shuffle built
    already, when it is not empty), then found in the window's chunks (`cum`: their rows
    before each, `first`: their first plan rows). One call a batch, not six numpy ones."""
    shuffled = epoch_rows(local, m, key, True) if len(perm) == 0 else perm[local]
    out = np.empty(len(local), np.int64)
    for i in range(len(local)):
        x = shuffled[i]
        c = np.searchsorted(cum, x, side="right") - 1
        out[i] = first[c] + x - cum[c]
    return out


@nb.njit(cache=CACHE, inline="always")
def _feistel_inverse(y, n, half, mask, k):
    while True:  # the rounds of `_feistel` undone in reverse order; cycle walking likewise
        left = y >> half
        right = y & mask
        for rnd in range(3, -1, -1):
            f = _mix64(left ^ (k + np.uint64(rnd) * np.uint64(0x9E3779B97F4A7C15))) & mask
            left, right = right ^ f, left
        y = (left << half) | right
        if y < n:
            return y


@nb.njit(cache=CACHE, nogil=True)
def epoch_positions(rows, n, seed_key, e, shuffle):
    """The inverse of `epoch_rows` within epoch e: the position in the epoch (index - e·n)
    at which each plan row of `rows` is read. A skip of documents at resume uses it to
    find, in closed form, where the rows holding them fall in every later epoch."""
    out = np.empty(len(rows), np.int64)
    if not shuffle:
        for i in range(len(rows)):
            out[i] = rows[i]
        return out
    key = _epoch_key(seed_key, e)
    if n <= EXACT_SHUFFLE_MAX:
        perm = permutation(n, key)
        inverse = np.empty(n, np.int64)
        for i in range(n):
            inverse[perm[i]] = i
        for i in range(len(rows)):
            out[i] = inverse[rows[i]]
        return out
    half, mask = _feistel_halves(n)
    for i in range(len(rows)):
        out[i] = np.int64(_feistel_inverse(np.uint64(rows[i]), np.uint64(n), half, mask, key))
    return out
