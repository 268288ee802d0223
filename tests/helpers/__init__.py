"""What the test tiers share, imported as ``helpers.<module>``: the gloo rank pool, the
running service and its stand-ins, batches, layouts, the single-process reference. A test
module imports from here and from its own tier's ``*_cases.py`` modules, never from another
test module or a conftest, and never a private name (``tests/unit/test_house_rules.py``).
"""
