"""Prefix index, routing policy, load accounting, and the fleet simulator.

:mod:`.index` (prefix index from KV events), :mod:`.policy` (``kv`` and baselines),
:mod:`.load` (router-side in-flight accounting), :mod:`.simulator` / :mod:`.sim_report` /
:mod:`.cost_model` (``kvroute simulate``), :mod:`.workloads` / :mod:`.synthetic` (traces
and generators). Tenants and the OpenAI-compatible front door are still to come.
"""
