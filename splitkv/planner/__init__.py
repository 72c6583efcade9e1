"""The planner: how to cut a decode batch into work items, chosen by a fitted cost model.

Pure Python + NumPy/SciPy/PyYAML: it never imports CuPy, so plans can be made and inspected on
any machine.
"""

from .cost_model import CostModel
from .features import FEATURE_NAMES, plan_features
from .planner import Candidate, choose_plan, rank_candidates
from .profile_lookup import load_profile
from .profiles import Profile, ProfileError, read_profile

__all__ = ["FEATURE_NAMES", "Candidate", "CostModel", "Profile", "ProfileError", "choose_plan",
           "load_profile", "plan_features", "rank_candidates", "read_profile"]
