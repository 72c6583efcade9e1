"""`splitkv bench`: the standard decode cases (``cases``), timed by ``runtime.timing``'s method."""
