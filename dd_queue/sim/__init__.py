"""Goodput simulator at data-centre scale: failures, repairs and three training regimes.

``ddq simulate`` answers "what goodput do I get at N chips and my failure rate, and how many
learners do I need?", and makes the paper's headline checkable (Decoupled DiLoCo, Douillard et
al., arXiv 2604.21428: at 1.2M chips and one interruption per chip-year, 88% goodput for 8
learners vs 58% elastic data-parallel vs 27% plain data-parallel).

Definitions (``dd_queue.core.goodput``, the services' own arithmetic, reused here): **goodput** =
busy training chip-seconds ÷ allocated chip-seconds; **uptime** = share of wall time in which
training advances. **Global downtime** = wall time with no training (data-parallel) or with fewer
than K learners training (Decoupled DiLoCo).

Modules:

- ``config`` — the typed frozen config (``config/sim/default.yaml`` documents every default);
- ``failures`` — slice interruptions (aggregate Poisson, thinned), return times, chip speeds;
- ``timeline`` — elastic and SPMD group timelines (stalls, lost work, chips out);
- ``ledger`` — timelines → the core goodput ledger; global downtime;
- ``rounds`` — the synchronizer's rounds under the core quorum/grace policy;
- ``regimes`` — the three regimes on a shared failure history, repetitions;
- ``sweep``, ``report``, ``plots``, ``calibrate``, ``cli``.

**Complexity.** With N chips, S chips per slice, T simulated seconds, MTBI per chip, the job
sees E = N·T/MTBI interruptions (197 000 for 2.4M chips over 30 days, whatever S). Per
repetition: drawing failures O(E log E); chip speeds O(N) (the only per-chip work, ≈ 30 ms at
2.4M); each regime's timelines O(E log E) (sorts, running maxima, searchsorted — no Python loop
over events; M learners share the E events); the ledger O(E log E) in ``summarize_arrays``; the
rounds O(R·M log M) for R ≤ ``policy_rounds`` evaluated rounds (default 200 000). Memory
O(E + R·M + N/S). The 2.4M-chip, 30-day, M = 16 case runs in ≈ 2.5 s on 2 cores
(``bench/bench_sim.py``).
"""

from dd_queue.sim.config import SimConfig, load_sim_config
from dd_queue.sim.regimes import RegimeResult, simulate
from dd_queue.sim.sweep import run_sweep

__all__ = ["RegimeResult", "SimConfig", "load_sim_config", "run_sweep", "simulate"]
