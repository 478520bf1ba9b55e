"""Main-thread cost of one keep pack, taken apart: the session's _pack against copies of it cut short
(v0: the session's prelude and a handle; v1: + the tick and the plain-tensor test; v2: + the storage
lookup and the kept-scope tests; v3: + the record and the accounting), each called on 2000 tensors
outside autograd (the lambda around v0-v3 adds a frame the real hook does not have). Run from the
repository root."""
import sys, time, torch, logging, statistics, weakref
sys.path[:0] = ["benchmarks"]
logging.disable(logging.WARNING)
import microbench as mb
from swapkit.runtime.records import make_saved, KeptRecord
from swapkit.runtime import step as S
_TENSOR=torch.Tensor; _PARAMETER=torch.nn.Parameter; _STRIDED=torch.strided
gid = torch._C._current_graph_task_id
m = mb.TinyModel(2000, 16); x = torch.randn(16)
s = mb._session(m, False)
with s: m(x).backward()
xs = [torch.randn(16) for _ in range(2000)]
# Each variant is one function built from the stages up to its own (no call per stage: the real hook
# has none), so v3 is v2 plus the record stage, and so on.
PRELUDE = """
    frame = self.tracker.current
    if gid() != -1: return None
    step = self._step
    if step.backward_started: return None
    tick, record = 0, None
"""
TICK = """
    tick = step.clock
    step.clock = tick + 1
    if step._scheduled: pass
    if frame is not step._last_frame: step._frame_seen(frame)
    if (type(tensor) is not _TENSOR and type(tensor) is not _PARAMETER) or tensor.layout is not _STRIDED \\
            or tensor.is_nested or tensor.is_quantized:
        return None
"""
LOOKUP = """
    storage = tensor.untyped_storage()
    key, version = id(storage), tensor._version
    found = step._index.get(key)
    if (found() if found is not None else None) is None:
        if (frame is not None and frame.prefetch is not None) or step._recomputable.entries \\
                or key in step.param_storages or type(tensor) is not _TENSOR or tensor._base is not None \\
                or tensor.__dict__ or tensor.device != step.device:
            return None
        nbytes = storage.nbytes()
"""
RECORD = """
        step.stats.saved_bytes += nbytes
        step.bytes_changed(nbytes)
        if not tick & 16383: pass
        record = KeptRecord((step, nbytes, version, storage))
        step._index[key] = weakref.ref(record)
"""
HANDLE = """
    saved = make_saved((tensor.detach(), tensor._version, step, tick, record, None, frame))
    if self.observer is not None: pass
    return saved
"""
STAGES = (TICK, LOOKUP, RECORD)


def variant(n):
    """v<n>: the prelude, the first n stages and the handle, as one function."""
    namespace = {}
    exec("def v%d(self, tensor):" % n + PRELUDE + "".join(STAGES[:n]) + HANDLE, globals(), namespace)
    return namespace["v%d" % n]


VARIANTS = [variant(n) for n in range(len(STAGES) + 1)]


def run(pack):
    t0 = time.perf_counter()
    h = [pack(t) for t in xs]
    t1 = time.perf_counter()
    del h
    return (t1 - t0) / 2000 * 1e6
res = {}
for r in range(20):
    res.setdefault("floor", []).append(run(mb._keep_floor))
    with s:
        for f in VARIANTS:
            res.setdefault(f.__name__, []).append(run(lambda t, f=f: f(s, t)))
        res.setdefault("real", []).append(run(s._pack))
        s._step._index.clear()
for k, v in res.items():
    print(k, round(statistics.median(v), 3))
