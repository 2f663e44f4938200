"""The P:D planner: how many prefill and decode workers an offered load needs.

What each pool's worker sustains within its SLO is measured, never assumed: `record` reads
a `pdserve bench` JSON record, and `capacity` finds, per pool, the most tokens per second
one worker carried while the pool still met its SLO (TTFT for prefill, TPOT for decode,
DistServe's split). `plan` divides an offered load (a request rate, or what the routers'
live metrics say, `live`) by those capacities. `scaling` turns a plan into replica counts
within bounds, with hysteresis and a cool-down, and `kubernetes` applies them through the
Deployments' scale subresource; `loop` runs that as `pdserve planner`. The arithmetic
(`capacity`, `plan`, `scaling`) is pure: no I/O, no clock.
"""
