"""The fleet simulator: real block pools, real events, the real index and policy, modelled time.

:mod:`.simulator` (the discrete-event fleet; its configuration in :mod:`.config`),
:mod:`.report` (summaries, tables, plots), :mod:`.goodput` (rate sweeps and limit searches
against an SLO), :mod:`.bounds` (what no router can beat: hit rates, a throughput ceiling),
:mod:`.workloads` (request specs, token sources, built-in generators) and :mod:`.traces`
(Mooncake traces). It sits above
:mod:`kvroute.router` and :mod:`kvroute.replica`, as :mod:`kvroute.deploy` does; nothing
imports it but the CLI and the benchmarks.
"""
