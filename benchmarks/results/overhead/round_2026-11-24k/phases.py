# Forward and backward main-thread CPU per saved tensor over no hooks, interleaved in one process:
#   python phases.py ROOT
# the identity hooks; (o): (n) with engine_options.inline_bytes 0 (every copy handed to the copy thread);
# (n) with the default inline_bytes (small copies on the saving thread while no copy is queued); (n) with its
# engine closed after the warm-up (every copy on the saving thread, as way (h)).
import sys, time, torch, logging, statistics as st, contextlib
sys.path.insert(0, sys.argv[1] + "/benchmarks")
import microbench as mb
logging.getLogger("swapkit").setLevel(logging.ERROR)
x = torch.randn(16)
mi, mo, mn, mh = (mb.TinyModel(2000, 16) for _ in range(4))
so = mb._session(mo, True, native=True, inline_bytes=0)
sn, sh = (mb._session(m, True, native=True) for m in (mn, mh))
ways = {"none": (mi, contextlib.nullcontext), "identity": (mi, mb._identity_hooks),
        "o_every_copy_to_the_thread": (mo, lambda: so), "n": (mn, lambda: sn), "n_engine_closed": (mh, lambda: sh)}
res = {w: [] for w in ways}
T = time.thread_time
for rep in range(40):
    if rep == 2:
        sh.engine.close()
    for w, (m, c) in ways.items():
        m.zero_grad(set_to_none=True)
        ctx = c()
        t0 = T(); ctx.__enter__(); y = m(x); t2 = T(); y.backward(); t3 = T(); ctx.__exit__(None, None, None)
        del y
        if rep >= 5: res[w].append((t2-t0, t3-t2))
print("copy threads started:", {w: s.engine._worker is not None for w, s in (("o", so), ("n", sn))})
base = [st.median(c) for c in zip(*res["none"])]
for w, r in res.items():
    if w == "none": continue
    print(w, " ".join("%.2f" % ((st.median(col)-b)*1e6/2001) for col, b in zip(zip(*r), base)), "(fwd bwd us/save over none)")
