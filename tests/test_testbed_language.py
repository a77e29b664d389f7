"""Edge cases of the testbed grammar (mmspec/testbed/language.py)."""

from mmspec.testbed.world import World, WorldConfig


def test_yes_no_questions_when_every_colour_shape_pair_is_present():
    # 2 colours x 1 shape with 2 objects of different colours: nothing is absent, so an
    # "is there a ...?" question must be about a present pair and be answered "yes".
    cfg = WorldConfig(colours=("red", "blue"), shapes=("circle",), min_objects=2, max_objects=2)
    scenes = World(seed=0, config=cfg).sample(20)
    exists = [(q, a) for s in scenes for q, a in s.qa if q.startswith(("is there", "does the", "can you"))]
    assert exists, "expected some existence questions"
    assert all(a[0] == "yes" for _, a in exists)
