"""Communication between pipeline stages, and nothing else: the messages (`messages`), the links
that carry them along a micro-batch's path (`links`), the sampled tokens coming back to stage 0
(`tokens`), the start-up handshakes (`handshake`) and a link's measured bandwidth (`link_bench`)."""
