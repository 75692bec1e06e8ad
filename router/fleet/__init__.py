"""The replicas as one front door runs them: membership, data-plane connections, a
request's run (failover, quarantine), admission, tenants and their limits, the names they may carry
(:mod:`kvroute.router.frontdoor`, above the rooms, ties them into one runtime)."""
