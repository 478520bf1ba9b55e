# Forward and backward main-thread CPU per saved tensor over no hooks, interleaved in one process:
#   python phases.py ROOT          the identity hooks, (d), (n), and (n) copying on the saving thread
#   python phases.py ROOT noop     (n), (n) with copy jobs that copy nothing, (n) inline (round j's noop_copies)
#   python phases.py ROOT handoff  (o): (n) with engine_options.inline_bytes 0 (every copy handed to the copy
#                                  thread), (n), (n) with its engine closed (rounds k's and l's phases.txt)
import sys, time, torch, logging, statistics as st, contextlib
sys.path.insert(0, sys.argv[1] + "/benchmarks")
import microbench as mb
logging.getLogger("swapkit").setLevel(logging.ERROR)
noop, handoff = sys.argv[2:] == ["noop"], sys.argv[2:] == ["handoff"]
x = torch.randn(16)
mi = mb.TinyModel(2000, 16); mo = mb.TinyModel(2000, 16); mn = mb.TinyModel(2000, 16); mh = mb.TinyModel(2000, 16)
so = mb._session(mo, True, native=noop or handoff, **({"inline_bytes": 0} if handoff else {}))
sn = mb._session(mn, True, native=True); sh = mb._session(mh, True, native=True)
ways = {"none": (mi, contextlib.nullcontext), "identity": (mi, mb._identity_hooks),
        "o_every_copy_to_the_thread" if handoff else "n_noop_copies" if noop else "d": (mo, lambda: so),
        "n": (mn, lambda: sn), "n_engine_closed" if handoff else "n_inline": (mh, lambda: sh)}
res = {w: [] for w in ways}
T = time.thread_time
for rep in range(40):
    if rep == 2:
        sh.engine.close()
        if noop:
            so.engine._copy_region = lambda *a, **k: None; so.engine._copy = lambda *a, **k: None
    for w, (m, c) in ways.items():
        m.zero_grad(set_to_none=True)
        ctx = c()
        t0 = T(); ctx.__enter__(); y = m(x); t2 = T(); y.backward(); t3 = T(); ctx.__exit__(None, None, None)
        del y
        if rep >= 5: res[w].append((t2-t0, t3-t2))
if handoff:
    print("copy threads started:", {w: s.engine._worker is not None for w, s in (("o", so), ("n", sn))})
base = [st.median(c) for c in zip(*res["none"])]
for w, r in res.items():
    if w == "none": continue
    print(w, " ".join("%.2f" % ((st.median(col)-b)*1e6/2001) for col, b in zip(zip(*r), base)), "(fwd bwd us/save over none)")
