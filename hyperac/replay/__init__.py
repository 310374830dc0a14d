"""What makes a replay exact: a recomputed region's replay reads what its forward read, changes nothing the
forward changed once, and is checked against the forward.

Each piece is entered once per region invocation (its snapshot taken as the forward starts) and once per
replay, and costs host time on every layer invocation (benchmarks/host_overhead.py measures it per
mechanism). Where each guarantee and its cost are written down:

* python_state.py    NOTE [Python state in the replay]: attributes, hook tables, hook closures, borrowed
                     modules, generators, seen as the forward saw them and left as the replay found them;
                     how generators are read: NOTE [Generators read as bytes]; what keeps it cheap: NOTE [Dict
                     versions], NOTE [A snapshot taken again] (a layer's next invocation takes the same snapshot
                     where a witness of versions and flags says nothing it saw has changed).
* random_sources.py  NOTE [RNG trackers], NOTE [Kept ops that draw random numbers]: every random source a
                     region drew from is replayed.
* replay_context.py  NOTE [The forward's context in the replay]: parametrize caching, default dtype,
                     deterministic algorithms, SDPA kernels; how the flags are read: NOTE [Torch's flags read
                     as memory].
* memory.py          the process's memory as words, where the checks above read what probes found in one C
                     call (dict versions, torch's flags).
* buffers.py         NOTE [Buffers in the replay], NOTE [Non-persistent buffers are held, not copied]: buffer
                     updates happen once, the replay reads the buffers its forward read.
* region_saves.py    NOTE [One hook pair per region]: one saved-tensor hook pair per region invocation, in one
                     Python call per tensor, for the next three; NOTE [Checkpoint's hooks in the region's pair]:
                     ``full``'s pair also does torch's checkpoint hooks' work (probed at apply).
* replay_check.py    NOTE [Every replay is checked], NOTE [Autocast casts served from the cache]: ``full``'s
                     replay fingerprinted against its forward.
* reread.py          NOTE [A saved tensor read twice in one backward].
* freed_saves.py     NOTE [Saved tensors freed in forward]: a forward that frees a saved tensor is refused.
* routing.py         NOTE [Routing is kept]: what decides a data-dependent route (an MoE router's top-k) is
                     taken from the forward in every replay; ``full`` watches a layer's first forward for it.

recompute.py (one level up) builds these per region invocation; the selective modes' own op-by-op check is
in policy.py.
"""
