"""The swap-everything way of the microbench, thread engine against copies inline (argument
'inline': the engine closed after one step): main-thread CPU, wall time, user and system time and
context switches of the main thread per step (getrusage RUSAGE_THREAD). Run from the repository root."""
import sys, torch, logging, time, statistics, os, resource
sys.path[:0] = ["benchmarks"]
logging.disable(logging.WARNING)
import microbench as mb
m = mb.TinyModel(2000, 16); x = torch.randn(16)
s = mb._session(m, True)
with s: m(x).backward()
if sys.argv[1] == "inline": s.engine.close()
ts, ws = [], []
ru0 = resource.getrusage(resource.RUSAGE_THREAD)
for i in range(15):
    t0 = time.thread_time(); w0 = time.perf_counter()
    with s: m(x).backward()
    ts.append(time.thread_time() - t0); ws.append(time.perf_counter() - w0)
ru1 = resource.getrusage(resource.RUSAGE_THREAD)
print(sys.argv[1], "main cpu", round(statistics.median(ts) * 1e3, 1), "ms wall", round(statistics.median(ws) * 1e3, 1),
      "utime", round((ru1.ru_utime - ru0.ru_utime) / 15 * 1e3, 1), "stime", round((ru1.ru_stime - ru0.ru_stime) / 15 * 1e3, 1),
      "vcsw", (ru1.ru_nvcsw - ru0.ru_nvcsw) // 15, "ivcsw", (ru1.ru_nivcsw - ru0.ru_nivcsw) // 15)
