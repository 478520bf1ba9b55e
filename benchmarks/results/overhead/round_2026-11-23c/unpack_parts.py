"""Main-thread cost of one keep unpack, outside autograd: the session's _unpack against its first
lines (u1: version check; u2: + the step and record tests). Run from the repository root."""
import sys, time, torch, logging, statistics
sys.path[:0] = ["benchmarks"]
logging.disable(logging.WARNING)
import microbench as mb
m = mb.TinyModel(2000, 16); x = torch.randn(16)
s = mb._session(m, False)
with s: m(x).backward()
xs = [torch.randn(16) for _ in range(2000)]
def u1(saved):
    keeper, version, step, tick, record = saved[:5]
    if keeper._version != version: raise RuntimeError
    return keeper
def u2(saved):
    keeper, version, step, tick, record = saved[:5]
    if keeper._version != version: raise RuntimeError
    if step is not None and step.watch_unpacks: pass
    if record is None or not record.released: tensor = keeper
    return keeper
res = {}
for r in range(20):
    with s:
        h = [s._pack(t) for t in xs]
    s._step.watch_unpacks = False
    for name, f in (("u1", u1), ("u2", u2), ("real", s._unpack)):
        t0 = time.perf_counter()
        for v in h: f(v)
        res.setdefault(name, []).append((time.perf_counter() - t0) / 2000 * 1e6)
    print(s._step.watch_unpacks, end=" ")
    del h
for k, v in res.items():
    print(k, round(statistics.median(v), 3))
