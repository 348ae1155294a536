"""Loss curves as PNG: matplotlib when it is installed, otherwise a tiny built-in writer (zlib and
the PNG chunk format, no dependency) that draws the curves, a frame, dotted grid lines at round
loss values and a colour key (series in order: blue, red, green, ...) but no text: the numbers
are in the JSON written beside it."""
import struct
import zlib

COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14)]


def _png(path, w, h, pixels):
    raw = b"".join(b"\x00" + bytes(pixels[y * w * 3:(y + 1) * w * 3]) for y in range(h))

    def chunk(tag, data):
        return (struct.pack(">I", len(data)) + tag + data +
                struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)))
        f.write(chunk(b"IDAT", zlib.compress(raw, 9)))
        f.write(chunk(b"IEND", b""))


def _fallback(path, series, title, w=800, h=480):
    px = bytearray([255] * (w * h * 3))
    L, R, T, B = 50, 20, 30, 40  # margins

    def put(x, y, c):
        if 0 <= x < w and 0 <= y < h:
            i = (y * w + x) * 3
            px[i:i + 3] = bytes(c)

    xs_all = [x for xs, _ in series.values() for x in xs]
    ys_all = [y for _, ys in series.values() for y in ys]
    if not xs_all:
        _png(path, w, h, px)
        return
    x0, x1 = min(xs_all), max(xs_all) or 1
    y0, y1 = min(ys_all), max(ys_all)
    if y1 <= y0:
        y1 = y0 + 1

    def sx(x):
        return int(L + (x - x0) / max(x1 - x0, 1e-9) * (w - L - R))

    def sy(y):
        return int(h - B - (y - y0) / (y1 - y0) * (h - T - B))

    step = 10 ** int(__import__("math").floor(__import__("math").log10(max(y1 - y0, 1e-9))))
    g = (int(y0 / step) + 1) * step
    while g < y1:
        for x in range(L, w - R, 3):
            put(x, sy(g), (200, 200, 200))
        g += step
    for x in range(L, w - R):
        put(x, h - B, (0, 0, 0))
        put(x, T, (0, 0, 0))
    for y in range(T, h - B + 1):
        put(L, y, (0, 0, 0))
        put(w - R, y, (0, 0, 0))
    for k, (name, (xs, ys)) in enumerate(series.items()):
        c = COLORS[k % len(COLORS)]
        for y in range(8 + 14 * k, 18 + 14 * k):  # colour key, top left
            for x in range(L + 8, L + 28):
                put(x, y, c)
        pts = [(sx(x), sy(y)) for x, y in zip(xs, ys)]
        for (ax, ay), (bx, by) in zip(pts, pts[1:]):
            n = max(abs(bx - ax), abs(by - ay), 1)
            for i in range(n + 1):
                put(ax + (bx - ax) * i // n, ay + (by - ay) * i // n, c)
    _png(path, w, h, px)


def plot_curves(path, series, title, xlabel="step", ylabel="loss"):
    """series: {name: (xs, ys)}. Returns 'matplotlib' or 'builtin' (which writer drew it)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        _fallback(path, series, title)
        return "builtin"
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=100)
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, label=name, linewidth=1.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "matplotlib"
