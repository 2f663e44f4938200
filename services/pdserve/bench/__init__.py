"""`pdserve bench`: an open-loop serving benchmark against one router or several clusters.

One module per job: `workload` plans the requests (arrivals and lengths, from a seed),
`loadgen` sends them and times every token, `sweep` runs every rate against each target in
rotation, `metrics` turns the timings into percentiles, SLO attainment and goodput,
`report` writes JSON and Markdown, `plots` draws the figures (matplotlib: the
`pdserve[bench]` extra), and `pdserve.commands.bench` is the CLI that ties them together.
`machine` reads the machine (CPU model, CPU time, others' load) for it and for the
component benchmarks in bench/, which share `component` too.
"""
