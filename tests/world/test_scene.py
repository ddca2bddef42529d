"""Scenes of the demo world (predictor_training/world/scene.py): deterministic, boxes all around
the start point, captions that group and count them."""

import math

import numpy as np

from predictor_training.world import Box, WorldScene, make_scene
from predictor_training.world.scene import BOX_PALETTE, GROUND_Y, MIN_ORIGIN_CLEARANCE, footprint_distance


def _box(colour: str, x: float, z: float, side: float, height: float | None = None, kind: str = "cube") -> Box:
    height = side if height is None else height
    return Box(kind, colour, BOX_PALETTE[colour], (x - side / 2, GROUND_Y - height, z - side / 2),
               (x + side / 2, GROUND_Y, z + side / 2))


def _hand_scene(*boxes: Box) -> WorldScene:
    return WorldScene(seed=-1, boxes=boxes, ground_names=("grey", "white"),
                      ground_colours=((0.5, 0.5, 0.52), (0.85, 0.85, 0.86)), cell_size=0.7,
                      sky_name="a pale blue sky", horizon=(0.8, 0.87, 0.95), zenith=(0.4, 0.62, 0.9))


# =============================================================================================================
# scenes
# =============================================================================================================
def test_scenes_are_deterministic_and_put_boxes_all_around_the_start_point():
    assert make_scene(5) == make_scene(5) and make_scene(5).caption() == make_scene(5).caption()
    assert make_scene(5) != make_scene(6)
    for seed in range(30):
        scene = make_scene(seed)
        assert 5 <= len(scene.boxes) <= 9
        angles = []
        for index, box in enumerate(scene.boxes):
            assert box.hi[1] == GROUND_Y and box.lo[1] < GROUND_Y  # standing on the ground
            assert footprint_distance(box, 0.0, 0.0) >= MIN_ORIGIN_CLEARANCE
            centre_x, _, centre_z = box.centre
            assert 2.0 - 1e-6 <= math.hypot(centre_x, centre_z) <= 6.0 + 1e-6
            angles.append(math.degrees(math.atan2(centre_x, centre_z)) % 360)
            for other in scene.boxes[index + 1:]:  # footprints do not overlap
                assert (box.hi[0] <= other.lo[0] or other.hi[0] <= box.lo[0]
                        or box.hi[2] <= other.lo[2] or other.hi[2] <= box.lo[2])
        angles.sort()
        gaps = np.diff(angles + [angles[0] + 360])
        assert gaps.max() < 90, (seed, angles)
        caption = scene.caption()
        assert f"on a {scene.ground_names[0]} and {scene.ground_names[1]} checkered ground under {scene.sky_name}" \
            in caption
        assert all(box.colour_name in caption for box in scene.boxes)


def test_caption_groups_and_counts_boxes():
    scene = _hand_scene(_box("red", 0, 3, 0.5, 2.5, "pillar"), _box("blue", 2, 3, 0.8), _box("yellow", -2, 3, 0.8),
                        _box("blue", 3, -1, 0.8))
    assert scene.caption() == ("two blue cubes, a red pillar and a yellow cube on a grey and white checkered ground "
                               "under a pale blue sky")
