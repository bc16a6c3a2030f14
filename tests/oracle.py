"""`Oracle`: an engine whose draft proposes a known greedy continuation, so tests drive the accepted paths.

A random tiny draft is almost never right; the wrapper replaces its proposals with the target's own greedy
continuation (known from a baseline run), optionally spoiled at chosen positions, while every call still runs
the wrapped engine's methods.
"""


class Oracle:
    """`engine` with its draft's proposals replaced by the known greedy sequence `seq` (prompt + continuation):
    the draft query at position i proposes seq[i + 2], unless `wrong(j)` for the j-th proposal of a round."""

    def __init__(self, engine, seq, wrong=lambda j: False):
        self.engine, self.seq, self.wrong, self.meta = engine, seq, wrong, engine.meta
        self.j = 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def target_verify(self, tokens, input_pos):
        self.j = 0
        return self.engine.target_verify(tokens, input_pos)

    def draft_decode(self, tokens, feature, input_pos):
        ids, g, logits = self.engine.draft_decode(tokens, feature, input_pos)
        i = int(input_pos[-1]) + 2
        if tokens.shape[1] > 1:  # a (re)seed: the first proposal of a round
            self.j = 0
        if i < len(self.seq):
            ids = ids.clone()
            ids[0, -1] = self.seq[i] if not self.wrong(self.j) else (self.seq[i] + 1) % self.meta["vocab_size"]
        self.j += 1
        return ids, g, logits

    def draft_chain(self, k, tokens, feature, input_pos):
        """A round's k proposals in one call (runner.engine.Engine.draft_chain): proposal j at position
        input_pos[-1] + j, replaced as draft_decode's are."""
        ids = self.engine.draft_chain(k, tokens, feature, input_pos).clone()
        for j in range(k):
            i = int(input_pos[-1]) + j + 2
            if i < len(self.seq):
                ids[0, j] = self.seq[i] if not self.wrong(j) else (self.seq[i] + 1) % self.meta["vocab_size"]
        return ids
