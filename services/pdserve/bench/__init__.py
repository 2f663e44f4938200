"""`pdserve bench`: an open-loop serving benchmark against one router or several clusters.

One module per job: `workload` plans the requests (arrivals and lengths, from a seed),
`loadgen` sends them and times every token, `metrics` turns the timings into percentiles,
SLO attainment and goodput, `report` writes JSON and Markdown, `plots` draws the figures,
and `command` is the CLI that ties them together.
"""
