"""Several choices per request (a batch of prompts, ``n`` > 1, ``best_of``'s candidates) and
OpenAI's ``echo``: how many runs a request makes and whether it may (:mod:`.count`), the
answer whole (:mod:`.respond`) or streamed interleaved (:mod:`.stream`), and the prompt
given back ahead of each run's first delta (:mod:`.echo`). A room of its own because a single
choice never needs it: each choice is a run of its own, and these modules fan a request out
into runs and gather their answers back into one, beside :mod:`kvroute.router.api.responses`,
which answers the single run."""
