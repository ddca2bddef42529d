"""Memory-frame retrieval: which earlier latents a chunk of the AR loop reads as its context.

Memory retrieval (``select_aligned_memory_frames``): the AR loop's context for the chunk starting at latent ``cur`` is
all previous latents while ``cur <= memory_frames``; afterwards it is latents [0, 4), the 4-latent history group whose
cameras best overlap the chunk's cameras (Monte-Carlo FOV overlap, 60 x 35 deg, range 8) and the last
``temporal_context_size`` latents. The Monte-Carlo points always come from stored points or an explicit
``torch.Generator``, never from the global RNG.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

RETRIEVAL_NUM_POINTS = 50000
RETRIEVAL_RADIUS = 8.0  # ball of Monte-Carlo points around the query camera, and max range of the history camera
RETRIEVAL_FOV_DEG = (60.0, 35.0)  # horizontal, vertical
MEMORY_GROUP_SIZE = 4  # history candidates are 4-latent groups starting at multiples of 4; always-kept group [0, 4)


def sample_retrieval_points(
    generator: torch.Generator, num_points: int = RETRIEVAL_NUM_POINTS, radius: float = RETRIEVAL_RADIUS
) -> torch.Tensor:
    """Uniform points in a ball, drawn from ``generator`` (three successive ``torch.rand(num_points)`` draws).

    Returns:
        [num_points, 3] float32 on the generator's device.
    """
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    u_radius = torch.rand(num_points, generator=generator, device=generator.device)
    u_azimuth = torch.rand(num_points, generator=generator, device=generator.device)
    u_polar = torch.rand(num_points, generator=generator, device=generator.device)
    r = radius * torch.pow(u_radius, 1 / 3)
    phi = 2 * math.pi * u_azimuth
    theta = torch.acos(1 - 2 * u_polar)
    x = r * torch.sin(theta) * torch.cos(phi)
    y = r * torch.sin(theta) * torch.sin(phi)
    z = r * torch.cos(theta)
    return torch.stack((x, y, z), dim=1)


def make_retrieval_points(
    seed: int, num_points: int = RETRIEVAL_NUM_POINTS, radius: float = RETRIEVAL_RADIUS
) -> torch.Tensor:
    """The retrieval point set for ``seed`` ([num_points, 3] float32, CPU); same as ``torch.manual_seed(seed)`` +
    three ``torch.rand`` draws, without touching the global RNG."""
    return sample_retrieval_points(torch.Generator(device="cpu").manual_seed(seed), num_points, radius)


def fov_overlap_ratios(
    w2c: torch.Tensor,
    query_frames: Sequence[int],
    history_frames: Sequence[int],
    points: torch.Tensor,
    fov_deg: tuple[float, float] = RETRIEVAL_FOV_DEG,
    max_distance: float = RETRIEVAL_RADIUS,
    history_chunk: int = 16,
) -> torch.Tensor:
    """Monte-Carlo FOV overlap of each history camera with each query camera.

    For query q the points are placed around camera q (in q's frame); ``ov(q, j)`` = #(points in view of q and of j,
    and within ``max_distance`` of j) / #(points in view of q), 0 when no point is in view of q.

    Args:
        w2c: [T, 4, 4] float64 world-to-camera.
        query_frames, history_frames: latent indices.
        points: [N, 3] Monte-Carlo points (float32).
    Returns:
        [len(query_frames), len(history_frames)] float32.
    """
    half_h, half_v = fov_deg[0] / 2.0, fov_deg[1] / 2.0
    points64 = points.to(device="cpu", dtype=torch.float64)
    history = torch.as_tensor(list(history_frames), dtype=torch.long)
    ratios = torch.zeros(len(query_frames), len(history), dtype=torch.float32)
    for row, query in enumerate(query_frames):
        # 1. query camera and history cameras expressed in the query camera's frame (as the original: twice inverted)
        query_w2c = w2c[query]
        query_centre, query_pitch, query_yaw = _camera_centre_and_angles(
            torch.linalg.inv(query_w2c @ torch.linalg.inv(query_w2c))[None]
        )
        around_query = points64 + query_centre[0]  # [N, 3]
        in_query = _inside_fov(around_query, query_centre[0], query_pitch[0], query_yaw[0], half_h, half_v)  # [N]
        query_count = in_query.sum()
        if query_count == 0:
            continue
        # 2. history cameras in chunks to bound memory: [J, N] masks
        for start in range(0, len(history), history_chunk):
            frames = history[start : start + history_chunk]
            relative_w2c = torch.linalg.inv(query_w2c @ torch.linalg.inv(w2c[frames]))  # [J, 4, 4]
            centres, pitch, yaw = _camera_centre_and_angles(relative_w2c)
            in_view = _inside_fov(
                around_query[None], centres[:, None, :], pitch[:, None], yaw[:, None], half_h, half_v
            )
            in_range = torch.linalg.vector_norm(around_query[None] - centres[:, None, :], dim=-1) < max_distance
            overlap = (in_query[None] & in_view & in_range).sum(dim=-1)  # [J]
            ratios[row, start : start + len(frames)] = overlap.float() / query_count.float()
    return ratios


def memory_candidate_distances(
    w2c,
    current_frame_idx: int,
    temporal_context_size: int = 12,
    pred_latent_size: int = 4,
    points: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[tuple[int, float]]:
    """(candidate group start, distance) for every history group start h in ``range(4, cur - context, 4)``.

    ``dist(h)`` = mean over the query latents q in [cur, min(cur + pred, T)) of
    ``((1 - ov(q, h)) + (1 - ov(q, h + 2))) / 2``. Candidates come back in ascending start order.

    Args:
        w2c: [T, 4, 4] world-to-camera (tensor or array; used in float64).
        points / generator: the Monte-Carlo points, or a generator to draw them from (only drawn when there is at
            least one candidate). Exactly one must be given.
    """
    w2c = _as_w2c_tensor(w2c)
    _check_points_source(points, generator)
    candidates = list(range(MEMORY_GROUP_SIZE, current_frame_idx - temporal_context_size, MEMORY_GROUP_SIZE))
    if not candidates:
        return []
    query_frames = list(range(current_frame_idx, min(current_frame_idx + pred_latent_size, w2c.shape[0])))
    if not query_frames:
        raise ValueError(f"current_frame_idx {current_frame_idx} leaves no query frame among {w2c.shape[0]} latents")
    if points is None:
        points = sample_retrieval_points(generator)
    history_frames = sorted({frame for start in candidates for frame in (start, start + 2)})
    ratios = fov_overlap_ratios(w2c, query_frames, history_frames, points)
    column = {frame: index for index, frame in enumerate(history_frames)}
    distances = []
    for start in candidates:
        # Python-float accumulation in the original's order, so equal inputs give equal distances
        total = 0.0
        for row in range(len(query_frames)):
            first = 1.0 - float(ratios[row, column[start]])
            second = 1.0 - float(ratios[row, column[start + 2]])
            total += (first + second) / 2.0
        distances.append((start, total / len(query_frames)))
    return distances


def select_aligned_memory_frames(
    w2c,
    current_frame_idx: int,
    memory_frames: int = 20,
    temporal_context_size: int = 12,
    pred_latent_size: int = 4,
    points: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Sorted latent indices used as context for the chunk starting at ``current_frame_idx``.

    * ``cur <= memory_frames``: ``[0, cur)``.
    * otherwise: ``[0, 4)`` plus the best history groups (smallest ``memory_candidate_distances``, ties to the lower
      start) until ``memory_frames - temporal_context_size`` memory latents are held, plus ``[cur - context, cur)``.

    Args:
        w2c: [T, 4, 4] world-to-camera (tensor or array; used in float64).
        points: [N, 3] Monte-Carlo points (``make_retrieval_points``), or
        generator: a seeded ``torch.Generator`` to draw them from. Exactly one must be given; pass the same
            ``points`` to every call of one trajectory to reproduce the original (which draws them once per video).
    """
    w2c = _as_w2c_tensor(w2c)
    _check_points_source(points, generator)
    if current_frame_idx < 0:
        raise ValueError(f"current_frame_idx must be >= 0, got {current_frame_idx}")
    if current_frame_idx <= memory_frames:
        return list(range(current_frame_idx))
    if current_frame_idx >= w2c.shape[0]:
        raise ValueError(f"current_frame_idx {current_frame_idx} is outside the {w2c.shape[0]} latents of w2c")

    memory = list(range(MEMORY_GROUP_SIZE))
    memory_budget = memory_frames - temporal_context_size
    distances = memory_candidate_distances(
        w2c, current_frame_idx, temporal_context_size, pred_latent_size, points=points, generator=generator
    )
    for start, _ in sorted(distances, key=lambda item: item[1]):  # sorted() is stable: ties keep the lower start
        if len(memory) >= memory_budget:
            break
        memory.extend(range(start, start + MEMORY_GROUP_SIZE))
    context = range(max(0, current_frame_idx - temporal_context_size), current_frame_idx)
    return sorted(set(memory) | set(context))


def _camera_centre_and_angles(w2c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Camera centres [J, 3] and view-direction pitch / yaw [J] in degrees of world-to-camera matrices [J, 4, 4]."""
    rotation, translation = w2c[:, :3, :3], w2c[:, :3, 3]
    centre = (-rotation.transpose(1, 2) @ translation[:, :, None])[:, :, 0]
    # view direction = camera +z axis in world coordinates = third row of the w2c rotation
    x, y, z = rotation[:, 2, 0], rotation[:, 2, 1], rotation[:, 2, 2]
    yaw = torch.atan2(x, z) * (180.0 / math.pi)
    pitch = torch.atan2(y, torch.sqrt(x**2 + z**2)) * (180.0 / math.pi)
    return centre, pitch, yaw


def _inside_fov(points, centre, pitch, yaw, half_h: float, half_v: float) -> torch.Tensor:
    """Boolean mask of points whose direction from ``centre`` is within the half FOVs of (yaw, pitch), degrees."""
    offset = points - centre
    x, y, z = offset[..., 0], offset[..., 1], offset[..., 2]
    azimuth = torch.atan2(x, z) * (180 / math.pi)
    elevation = torch.atan2(y, torch.sqrt(x**2 + z**2)) * (180 / math.pi)
    azimuth_diff = torch.remainder(azimuth - yaw + 180, 360) - 180
    elevation_diff = torch.remainder(elevation - pitch + 180, 360) - 180
    return (azimuth_diff.abs() < half_h) & (elevation_diff.abs() < half_v)


def _as_w2c_tensor(w2c) -> torch.Tensor:
    if isinstance(w2c, torch.Tensor):
        matrices = w2c.detach().to(device="cpu", dtype=torch.float64)
    else:
        matrices = torch.as_tensor(np.asarray(w2c, dtype=np.float64))
    if matrices.ndim != 3 or matrices.shape[1:] != (4, 4):
        raise ValueError(f"w2c must have shape [T, 4, 4], got {tuple(matrices.shape)}")
    return matrices


def _check_points_source(points: torch.Tensor | None, generator: torch.Generator | None) -> None:
    if (points is None) == (generator is None):
        raise ValueError(
            "pass exactly one of points (e.g. make_retrieval_points(seed)) or a seeded torch.Generator; "
            "the global RNG is never used for retrieval"
        )
    if points is not None and (points.ndim != 2 or points.shape[1] != 3):
        raise ValueError(f"points must have shape [N, 3], got {tuple(points.shape)}")
