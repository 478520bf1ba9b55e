import sys, collections
R = sys.argv[1]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__ and "editable" not in str(f)]
sys.path[:0] = [R, "benchmarks"]
import torch, microbench as mb, swapkit
for way in ("keep", "inline", "swap"):
    m = mb.TinyModel(2000, 16); x = torch.randn(16)
    s = mb._session(m, way != "keep")
    for _ in range(2):
        with s: m(x).backward()
    if way == "inline": s.engine.close()
    with s: m(x).backward()
    counts = collections.Counter()
    def prof(frame, event, arg):
        if event == "call": counts["py"] += 1
        elif event == "c_call": counts["c"] += 1
    import threading
    sys.setprofile(prof)
    for _ in range(3):
        with s: m(x).backward()
    sys.setprofile(None)
    n = 3 * 2001
    print(R, way, f"py calls/save {counts['py']/n:.2f}  c calls/save {counts['c']/n:.2f}")
    s.remove()
