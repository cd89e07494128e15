"""Float64 MXFP4 references written from the spec (mx_formats.md §1.3, §3, §5), for kernel tests."""

import numpy as np

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def f64_weight(packed, scale):
    """Decode `[..., out, in/2]` codes (low nibble = even element) and `[..., out, in/32]` scale
    bytes: E2M1[code] · 2^(byte − 127), 0xFF = NaN."""
    p, s = np.asarray(packed), np.asarray(scale).astype(np.float64)
    codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)
    return E2M1[codes] * np.repeat(np.where(s == 255, np.nan, np.exp2(s - 127)), 32, axis=-1)


def f64_gmm(x, packed, scale, sizes):
    """Each group's rows (sorted by expert, `sizes` per expert) times its expert's decoded
    weight; rows past the groups are 0."""
    x, wf = np.asarray(x, np.float64), f64_weight(packed, scale)
    y = np.zeros((x.shape[0], wf.shape[1]))
    start = 0
    for e, n in enumerate(sizes):
        y[start:start + n] = x[start:start + n] @ wf[e].T
        start += n
    return y
