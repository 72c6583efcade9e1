"""`splitkv bench`: the standard decode cases (``cases``), timed by ``measure.timing``'s method."""
