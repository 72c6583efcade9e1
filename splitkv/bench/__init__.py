"""`splitkv bench`: the standard decode cases of ANCHORS.md, timed the ANCHORS way."""
