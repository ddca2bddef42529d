"""Procedural demo-world scenes: a checkered ground, a sky gradient and coloured boxes all around the start point.

Axes are the start camera's OpenCV axes (x right, y down, z forward; the start camera is the identity pose at the
origin): the ground is the plane y = +1 (one unit below the eye), "up" is -y. Every solid is an axis-aligned box
standing on the ground: cubes (side 0.7-1.3) and tall pillars (0.4-0.7 wide, 2.2-3.6 high). ``make_scene(seed)``
places 5-9 of them at angles spread over the full circle around the origin (one per equal sector, jittered by at
most 10% of a sector), 2-6 units away, never closer than ``MIN_ORIGIN_CLEARANCE`` to the origin and never within
``MIN_BOX_GAP`` of each other, so a camera that turns on the spot always has a box in view.

Colours come from small named palettes, so ``WorldScene.caption()`` can say what the scene holds, e.g. "a red
pillar, two blue cubes and a yellow cube on a green and white checkered ground under a pale blue sky". Box colours
never repeat the ground's colour families. Everything is deterministic from the seed (``random.Random(seed)``, whose
stream Python keeps stable).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

GROUND_Y = 1.0  # the ground plane, in the start camera's OpenCV axes (y down): one unit below the eye
MIN_ORIGIN_CLEARANCE = 1.2  # no box footprint comes closer than this to the origin (the start point)
MIN_BOX_GAP = 0.3  # footprints of two boxes keep at least this gap along x or z
NUM_BOXES_RANGE = (5, 9)  # inclusive
DISTANCE_RANGE = (2.0, 6.0)  # distance of a box centre from the origin
SECTOR_JITTER = 0.1  # angular jitter of a box inside its sector, as a fraction of the sector

# name -> RGB in [0, 1]; "family" groups names a caption reader would confuse (a green box on green ground)
BOX_PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (0.84, 0.16, 0.14),
    "orange": (0.96, 0.53, 0.10),
    "yellow": (0.95, 0.83, 0.15),
    "green": (0.20, 0.66, 0.25),
    "teal": (0.10, 0.60, 0.60),
    "blue": (0.15, 0.32, 0.85),
    "purple": (0.52, 0.24, 0.72),
    "pink": (0.96, 0.50, 0.70),
    "white": (0.93, 0.93, 0.90),
    "black": (0.20, 0.20, 0.22),
}
BOX_FAMILY = {name: name for name in BOX_PALETTE}

# (name of colour a, name of colour b, family set, colour a, colour b)
GROUND_PALETTE: tuple[tuple[str, str, frozenset, tuple, tuple], ...] = (
    ("green", "white", frozenset({"green", "white"}), (0.33, 0.58, 0.30), (0.86, 0.88, 0.82)),
    ("grey", "white", frozenset({"white", "black"}), (0.50, 0.50, 0.52), (0.85, 0.85, 0.86)),
    ("sand", "brown", frozenset({"orange", "yellow"}), (0.86, 0.76, 0.56), (0.55, 0.40, 0.26)),
    ("dark green", "light green", frozenset({"green", "teal"}), (0.20, 0.42, 0.18), (0.55, 0.76, 0.42)),
    ("blue", "white", frozenset({"blue", "white", "teal"}), (0.38, 0.50, 0.78), (0.88, 0.90, 0.94)),
    ("black", "white", frozenset({"black", "white"}), (0.18, 0.18, 0.20), (0.88, 0.88, 0.88)),
)

# (caption words, horizon colour, zenith colour)
SKY_PALETTE: tuple[tuple[str, tuple, tuple], ...] = (
    ("a pale blue sky", (0.80, 0.87, 0.95), (0.40, 0.62, 0.90)),
    ("a deep blue sky", (0.66, 0.78, 0.93), (0.10, 0.30, 0.72)),
    ("an orange sunset sky", (0.98, 0.76, 0.55), (0.36, 0.40, 0.68)),
    ("a grey overcast sky", (0.80, 0.80, 0.82), (0.52, 0.54, 0.60)),
)

CUBE_SIDE_RANGE = (0.7, 1.3)
PILLAR_WIDTH_RANGE = (0.4, 0.7)
PILLAR_HEIGHT_RANGE = (2.2, 3.6)
PILLAR_PROBABILITY = 0.4
CELL_SIZE_RANGE = (0.5, 1.0)

_NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}


@dataclass(frozen=True)
class Box:
    """An axis-aligned box: ``lo`` / ``hi`` corners (x, y, z) in world units; kind "cube" or "pillar"."""

    kind: str
    colour_name: str
    colour: tuple[float, float, float]
    lo: tuple[float, float, float]
    hi: tuple[float, float, float]

    @property
    def centre(self) -> tuple[float, float, float]:
        return tuple((a + b) / 2 for a, b in zip(self.lo, self.hi))


@dataclass(frozen=True)
class WorldScene:
    """One procedural scene (see the module docstring). Build with ``make_scene(seed)`` or by hand (tests).

    Attributes:
        seed: the seed ``make_scene`` used (-1 for a hand-made scene).
        boxes: the solids.
        ground_names / ground_colours: the checker's two colours (names for the caption, RGB in [0, 1]).
        cell_size: checker cell edge in world units.
        sky_name: caption words of the sky ("a pale blue sky").
        horizon / zenith: sky gradient colours (the horizon colour is also the fog colour).
        ground_y: height of the ground plane (y down).
    """

    seed: int
    boxes: tuple[Box, ...]
    ground_names: tuple[str, str]
    ground_colours: tuple[tuple[float, float, float], tuple[float, float, float]]
    cell_size: float
    sky_name: str
    horizon: tuple[float, float, float]
    zenith: tuple[float, float, float]
    ground_y: float = GROUND_Y

    def caption(self) -> str:
        """"a red pillar, two blue cubes and a yellow cube on a green and white checkered ground under a pale blue
        sky": boxes grouped by (colour, kind), most numerous first, ties in palette then cube-before-pillar order."""
        counts: dict[tuple[str, str], int] = {}
        for box in self.boxes:
            counts[(box.colour_name, box.kind)] = counts.get((box.colour_name, box.kind), 0) + 1
        palette_order = list(BOX_PALETTE)

        def order(item):
            (colour, kind), count = item
            rank = palette_order.index(colour) if colour in palette_order else len(palette_order)
            return (-count, rank, colour, kind)

        parts = []
        for (colour, kind), count in sorted(counts.items(), key=order):
            if count == 1:
                article = "an" if colour[0] in "aeiou" else "a"
                parts.append(f"{article} {colour} {kind}")
            else:
                parts.append(f"{_NUMBER_WORDS.get(count, str(count))} {colour} {kind}s")
        if not parts:
            things = "an empty plain"
        elif len(parts) == 1:
            things = parts[0]
        else:
            things = ", ".join(parts[:-1]) + " and " + parts[-1]
        ground = f"{self.ground_names[0]} and {self.ground_names[1]} checkered ground"
        return f"{things} on a {ground} under {self.sky_name}"


def footprint_distance(box: Box, x: float, z: float) -> float:
    """Distance in the ground plane (x, z) from the point (x, z) to the box's footprint (0 inside it)."""
    dx = max(box.lo[0] - x, 0.0, x - box.hi[0])
    dz = max(box.lo[2] - z, 0.0, z - box.hi[2])
    return math.hypot(dx, dz)


def _footprints_apart(a: Box, b: Box, gap: float) -> bool:
    return (
        a.hi[0] + gap <= b.lo[0] or b.hi[0] + gap <= a.lo[0] or a.hi[2] + gap <= b.lo[2] or b.hi[2] + gap <= a.lo[2]
    )


def _make_box(rng: random.Random, colour_name: str, angle: float, distance: float) -> Box:
    if rng.random() < PILLAR_PROBABILITY:
        kind = "pillar"
        width = rng.uniform(*PILLAR_WIDTH_RANGE)
        depth = width * rng.uniform(0.8, 1.25)
        height = rng.uniform(*PILLAR_HEIGHT_RANGE)
    else:
        kind = "cube"
        width = depth = height = rng.uniform(*CUBE_SIDE_RANGE)
    # heading angle 0 = +z (straight ahead of the start camera), positive towards +x (to the right)
    cx, cz = distance * math.sin(angle), distance * math.cos(angle)
    lo = (round(cx - width / 2, 6), round(GROUND_Y - height, 6), round(cz - depth / 2, 6))
    hi = (round(cx + width / 2, 6), GROUND_Y, round(cz + depth / 2, 6))
    return Box(kind=kind, colour_name=colour_name, colour=BOX_PALETTE[colour_name], lo=lo, hi=hi)


def make_scene(seed: int) -> WorldScene:
    """The scene of ``seed`` (any int): deterministic, see the module docstring."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    rng = random.Random(seed)
    ground_a, ground_b, ground_families, colour_a, colour_b = rng.choice(GROUND_PALETTE)
    sky_name, horizon, zenith = rng.choice(SKY_PALETTE)
    cell_size = round(rng.uniform(*CELL_SIZE_RANGE), 4)
    box_colours = [name for name in BOX_PALETTE if BOX_FAMILY[name] not in ground_families]
    # a few colours per scene, so the caption groups boxes ("two blue cubes")
    scene_colours = rng.sample(box_colours, k=min(len(box_colours), rng.randint(3, 5)))

    num_boxes = rng.randint(*NUM_BOXES_RANGE)
    sector = 2 * math.pi / num_boxes
    offset = rng.uniform(0, sector)
    boxes: list[Box] = []
    for index in range(num_boxes):
        colour_name = rng.choice(scene_colours)
        for _attempt in range(200):
            angle = offset + index * sector + rng.uniform(-SECTOR_JITTER, SECTOR_JITTER) * sector
            distance = rng.uniform(*DISTANCE_RANGE)
            box = _make_box(rng, colour_name, angle, distance)
            if footprint_distance(box, 0.0, 0.0) < MIN_ORIGIN_CLEARANCE:
                continue
            if all(_footprints_apart(box, other, MIN_BOX_GAP) for other in boxes):
                boxes.append(box)
                break
        else:  # pragma: no cover - the sectors leave plenty of room; kept as a loud guard
            raise RuntimeError(f"make_scene({seed}): could not place box {index} without overlaps")
    return WorldScene(
        seed=seed,
        boxes=tuple(boxes),
        ground_names=(ground_a, ground_b),
        ground_colours=(colour_a, colour_b),
        cell_size=cell_size,
        sky_name=sky_name,
        horizon=horizon,
        zenith=zenith,
    )
