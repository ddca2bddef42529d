"""Vectorised ray casting of a ``WorldScene`` from exact cameras: uint8 frames [F, H, W, 3].

Per pixel sample, a ray from the camera centre through the sample point (``supersample`` x ``supersample`` samples
per pixel, at the centres of a regular sub-grid; the pixel is their mean). Nearest hit among: the boxes (slab test,
one vectorised pass per box), the ground plane y = ``scene.ground_y`` (OpenCV axes, y down), else the sky.

* Intrinsics: ``K`` is read the way the Teacher reads it (``camera.normalize_intrinsics``): focal lengths
  fx / (2 cx) and fy / (2 cy) of the image size, principal point at the image centre. So a render of any size is
  consistent with the normalised K the Teacher gets from the pose JSON (for ``camera.POSE_STRING_K``, a 1920 x 1080
  pixel K, this is the K scaled to width x height: about 89.4 deg x 58.2 deg of view; at 48 x 32 the pixels are not
  square, exactly as the Teacher's normalised K says).
* Shading: Lambert with one directional light (``LIGHT_DIRECTION``, from above, right and behind the start
  camera) plus an ambient term that differs per face orientation (tops brightest, then x faces, then z faces), so
  adjacent faces and box edges read; hard shadows of the boxes on the ground and on each other (a shadow ray per
  surface sample); the sky is a gradient from the horizon colour (at the horizon) to the zenith colour.
* Fog: surfaces blend towards the horizon colour with 1 - exp(-(distance / FOG_DISTANCE)^2): near boxes stay crisp,
  the ground meets the sky smoothly at the horizon.
* Anti-aliasing: supersampling, and the checker is box-filtered analytically over each sample's footprint on the
  ground (from the ray differentials of the plane hit), so it fades to the mean colour instead of aliasing far away.

Everything is element-wise torch (float32) with fixed reduction orders, so a render is deterministic on a machine.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np
import torch

from predictor_training.rollout.camera import POSE_STRING_K
from predictor_training.world.scene import WorldScene

LIGHT_DIRECTION = (0.45, -1.0, -0.55)  # towards the light (normalised below): up (-y), right (+x), behind (-z)
DIFFUSE = 0.62
FACE_AMBIENT = {  # (axis, +1 / -1 normal sign) -> ambient term; axis 1 with sign -1 is a top face (normal up)
    (0, 1): 0.30, (0, -1): 0.50,
    (1, -1): 0.50, (1, 1): 0.20,
    (2, 1): 0.30, (2, -1): 0.40,
}
GROUND_AMBIENT = 0.45
SHADOW_KEEP = 0.0  # fraction of the direct light a shadowed point still gets
FOG_DISTANCE = 16.0
SKY_EXPONENT = 0.6
_EPS = 1e-4


def render_intrinsics(height: int, width: int, K=POSE_STRING_K) -> np.ndarray:
    """[3, 3] float64 pixel K of a ``height`` x ``width`` render for the pose K ``K`` (read as ``render_frames``
    reads it: normalised focal lengths, centred principal point)."""
    K = np.asarray(K, dtype=np.float64)
    return np.array(
        [[K[0, 0] / (2 * K[0, 2]) * width, 0.0, width / 2], [0.0, K[1, 1] / (2 * K[1, 2]) * height, height / 2],
         [0.0, 0.0, 1.0]]
    )


def _light() -> torch.Tensor:
    light = torch.tensor(LIGHT_DIRECTION, dtype=torch.float32)
    return light / light.norm()


def _as_cameras(c2w) -> torch.Tensor:
    cameras = torch.as_tensor(np.asarray(c2w, dtype=np.float64))
    if cameras.ndim == 2:
        cameras = cameras[None]
    if cameras.ndim != 3 or cameras.shape[1:] != (4, 4):
        raise ValueError(f"c2w must have shape [F, 4, 4] (or [4, 4]), got {tuple(cameras.shape)}")
    if not torch.isfinite(cameras).all():
        raise ValueError("c2w holds non-finite values")
    return cameras


def _focal_lengths(K, num_frames: int, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-frame pixel focal lengths (fx, fy) [F] float64 of the render, from pixel K [3, 3] or [F, 3, 3]."""
    ks = np.asarray(K, dtype=np.float64)
    if ks.ndim == 2:
        ks = np.broadcast_to(ks, (num_frames, 3, 3))
    if ks.shape != (num_frames, 3, 3):
        raise ValueError(f"K must have shape [3, 3] or [F={num_frames}, 3, 3], got {ks.shape}")
    if not (ks[:, 0, 2] > 0).all() or not (ks[:, 1, 2] > 0).all() or not (ks[:, 0, 0] > 0).all():
        raise ValueError("K must be pixel intrinsics with fx, fy, cx, cy > 0")
    fx = ks[:, 0, 0] / (2 * ks[:, 0, 2]) * width
    fy = ks[:, 1, 1] / (2 * ks[:, 1, 2]) * height
    return torch.from_numpy(fx.copy()), torch.from_numpy(fy.copy())


def _box_tensors(scene: WorldScene) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """lo [B, 3], hi [B, 3] float32 numpy and colours [B, 3] float32 torch."""
    if not scene.boxes:
        return np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32), torch.zeros(0, 3)
    lo = np.array([box.lo for box in scene.boxes], dtype=np.float32)
    hi = np.array([box.hi for box in scene.boxes], dtype=np.float32)
    colours = torch.tensor([box.colour for box in scene.boxes], dtype=torch.float32)
    return lo, hi, colours


def _box_corners(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """[B, 8, 3] float64 corners of each box."""
    pick = np.array([[i >> 2 & 1, i >> 1 & 1, i & 1] for i in range(8)], dtype=np.float64)  # [8, 3]
    return lo[:, None, :].astype(np.float64) * (1 - pick) + hi[:, None, :].astype(np.float64) * pick


def _in_some_view(points: np.ndarray, rotation: np.ndarray, position: np.ndarray, tan_x, tan_y) -> np.ndarray:
    """[B] bool: the convex hull of each box's ``points`` [B, P, 3] may intersect the view frustum of at least one
    camera (rotation [F, 3, 3], position [F, 3], half-view tangents [F]). Conservative: a box is dropped only when
    all its points lie outside one frustum plane for every camera."""
    local = np.einsum("bpk,fkj->fbpj", points, rotation) - np.einsum("fk,fkj->fj", position, rotation)[:, None, None]
    x, y, z = local[..., 0], local[..., 1], local[..., 2]  # [F, B, P]
    tx, ty = (1.02 * tan_x)[:, None, None], (1.02 * tan_y)[:, None, None]
    outside = (
        (z <= 0).all(-1)
        | (x > tx * z).all(-1) | (-x > tx * z).all(-1)
        | (y > ty * z).all(-1) | (-y > ty * z).all(-1)
    )  # [F, B]
    return ~outside.all(0)


def _safe_inverse(d: torch.Tensor) -> torch.Tensor:
    tiny = torch.where(d >= 0, torch.full_like(d, 1e-12), torch.full_like(d, -1e-12))
    return 1.0 / torch.where(d.abs() < 1e-12, tiny, d)


def _slab(lo, hi, origin, inverse):
    """Entry and exit distances (t_near, t_far) of rays and one box, per component: origin / inverse are tuples of
    three tensors (or floats), lo / hi three floats."""
    t_near = t_far = None
    for axis in range(3):
        t0 = (float(lo[axis]) - origin[axis]) * inverse[axis]
        t1 = (float(hi[axis]) - origin[axis]) * inverse[axis]
        near, far = torch.minimum(t0, t1), torch.maximum(t0, t1)
        t_near = near if t_near is None else torch.maximum(t_near, near)
        t_far = far if t_far is None else torch.minimum(t_far, far)
    return t_near, t_far


def _filtered_square_wave(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Mean of the +-1 square wave (period 2, +1 on [0, 1)) over [p - w/2, p + w/2]: its integral is a triangle."""
    w = w.clamp(min=1e-3)

    def integral(x):
        return 1.0 - (torch.remainder(x, 2.0) - 1.0).abs()

    return (integral(p + 0.5 * w) - integral(p - 0.5 * w)) / w


def _trace(scene: WorldScene, rotation, position, fx, fy, height, width, samples, shadows, want_ids=False):
    """Colours [Fc, Hs, Ws, 3] float32 of the sample grid (Hs = height * samples), or box ids [Fc, Hs, Ws].

    Rays are kept per component ([Fc, N] tensors for x, y, z): cheaper than [Fc, N, 3] with last-dim reductions."""
    frames = rotation.shape[0]
    sample_h, sample_w = height * samples, width * samples
    rot64, pos64 = rotation.numpy(), position.numpy()
    rot = rotation.to(torch.float32)
    origin = tuple(position[:, axis].to(torch.float32)[:, None] for axis in range(3))  # 3 x [Fc, 1]
    # camera-frame direction of each sample (z = 1): x = (u - cx) / fx, y = (v - cy) / fy, u/v in pixels
    u = (torch.arange(sample_w, dtype=torch.float64) + 0.5) / samples - width / 2
    v = (torch.arange(sample_h, dtype=torch.float64) + 0.5) / samples - height / 2
    x_cam = (u[None, :] / fx[:, None]).to(torch.float32)[:, None, :].expand(frames, sample_h, sample_w)
    y_cam = (v[None, :] / fy[:, None]).to(torch.float32)[:, :, None].expand(frames, sample_h, sample_w)
    x_cam, y_cam = x_cam.reshape(frames, -1), y_cam.reshape(frames, -1)
    direction = tuple(
        x_cam * rot[:, axis, 0:1] + y_cam * rot[:, axis, 1:2] + rot[:, axis, 2:3] for axis in range(3)
    )  # 3 x [Fc, N], world frame, not normalised
    inverse = tuple(_safe_inverse(component) for component in direction)
    tan_x = (width / 2) / fx.numpy()
    tan_y = (height / 2) / fy.numpy()

    lo, hi, box_colours = _box_tensors(scene)
    corners = _box_corners(lo, hi)
    in_view = np.flatnonzero(_in_some_view(corners, rot64, pos64, tan_x, tan_y)) if len(lo) else []
    t_box = torch.full(x_cam.shape, math.inf)
    ids = torch.full(x_cam.shape, -1, dtype=torch.long)
    for index in in_view:
        t_near, t_far = _slab(lo[index], hi[index], origin, inverse)
        hit = (t_near <= t_far) & (t_near > _EPS) & (t_near < t_box)
        t_box = torch.where(hit, t_near, t_box)
        ids.masked_fill_(hit, int(index))

    dy = direction[1]
    height_above = scene.ground_y - origin[1]  # [Fc, 1]
    going_down = dy > 1e-9
    safe_dy = torch.where(going_down, dy, torch.ones_like(dy))
    t_ground = torch.where(going_down, height_above / safe_dy, torch.full_like(dy, math.inf))
    on_ground = going_down & (t_ground < t_box)
    on_box = (ids >= 0) & ~on_ground
    if want_ids:
        return torch.where(on_box, ids, torch.full_like(ids, -1)).reshape(frames, sample_h, sample_w)

    light = _light()
    horizon = torch.tensor(scene.horizon, dtype=torch.float32)
    zenith = torch.tensor(scene.zenith, dtype=torch.float32)
    length = torch.sqrt(direction[0].square() + dy.square() + direction[2].square())
    surface = on_ground | on_box
    t_hit = torch.where(on_ground, t_ground, torch.where(on_box, t_box, torch.zeros_like(t_box)))
    points = tuple(o + t_hit * d for o, d in zip(origin, direction))

    # which face of its box each box sample hit: the axis whose slab entry is the latest
    safe_ids = ids.clamp(min=0)
    if len(lo):
        lo_t, hi_t = torch.from_numpy(lo), torch.from_numpy(hi)
        entries = []
        for axis in range(3):
            t0 = (lo_t[safe_ids, axis] - origin[axis]) * inverse[axis]
            t1 = (hi_t[safe_ids, axis] - origin[axis]) * inverse[axis]
            entries.append(torch.minimum(t0, t1))
        axes = torch.where(
            (entries[0] >= entries[1]) & (entries[0] >= entries[2]), 0, torch.where(entries[1] >= entries[2], 1, 2)
        )
    else:
        axes = torch.zeros_like(ids)
    # normal along the hit axis, facing the ray: sign = -sign(direction[axis]); ground normal is (0, -1, 0)
    axis_direction = torch.where(axes == 0, direction[0], torch.where(axes == 1, dy, direction[2]))
    face_positive = axis_direction < 0  # normal points along +axis
    light_along = light[axes] * torch.where(face_positive, 1.0, -1.0)
    n_dot_l = torch.where(on_ground, -light[1], light_along).clamp(min=0.0)

    lit = torch.ones_like(t_hit)
    if shadows and len(lo):
        # cull with each box's shadow volume: corners + their projections along the light onto the ground
        shift = ((scene.ground_y - corners[..., 1]) / float(-light[1]))[..., None] * (-light.double().numpy())
        casters = np.flatnonzero(
            _in_some_view(np.concatenate([corners, corners + shift], axis=1), rot64, pos64, tan_x, tan_y)
        )
        receive = surface & (n_dot_l > 0)
        if len(casters) and bool(receive.any()):
            where = receive.nonzero(as_tuple=True)
            normal_offset = [torch.zeros_like(t_hit) for _ in range(3)]
            for axis in range(3):
                sign = torch.where(face_positive, 1e-3, -1e-3)
                normal_offset[axis] = torch.where(on_box & (axes == axis), sign, normal_offset[axis])
            normal_offset[1] = torch.where(on_ground, torch.full_like(t_hit, -1e-3), normal_offset[1])
            start = tuple((p + n)[where] for p, n in zip(points, normal_offset))  # 3 x [M]
            light_inverse = tuple(float(value) for value in _safe_inverse(light))
            blocked = torch.zeros_like(start[0], dtype=torch.bool)
            for index in casters:
                t_near, t_far = _slab(lo[index], hi[index], start, light_inverse)
                blocked |= (t_near <= t_far) & (t_near > 0)
            lit[where] = torch.where(blocked, SHADOW_KEEP, 1.0)

    # sky
    elevation = (-dy / length).clamp(0.0, 1.0).pow(SKY_EXPONENT)
    colour = horizon + (zenith - horizon) * elevation[..., None]

    # ground: analytically box-filtered checker over the sample footprint (ray differentials of the plane hit)
    cell = scene.cell_size
    scale = height_above / safe_dy.square()
    widths = []
    for axis in (0, 2):
        footprint = 0.0
        for column, focal in ((0, fx), (1, fy)):
            step = (rot[:, :, column] / focal[:, None].to(torch.float32)) / samples  # [Fc, 3] per sample
            footprint = footprint + (
                scale * (step[:, axis : axis + 1] * safe_dy - direction[axis] * step[:, 1:2])
            ).abs()
        widths.append(footprint / cell)
    ground_x = torch.where(on_ground, points[0], torch.zeros_like(t_hit)) / cell
    ground_z = torch.where(on_ground, points[2], torch.zeros_like(t_hit)) / cell
    checker = _filtered_square_wave(ground_x, widths[0]) * _filtered_square_wave(ground_z, widths[1])
    colour_a = torch.tensor(scene.ground_colours[0], dtype=torch.float32)
    colour_b = torch.tensor(scene.ground_colours[1], dtype=torch.float32)
    ground_colour = colour_b + (colour_a - colour_b) * (0.5 + 0.5 * checker)[..., None]
    ground_colour = ground_colour * (GROUND_AMBIENT + DIFFUSE * n_dot_l * lit)[..., None]

    # boxes: per-face ambient + Lambert
    ambient_table = torch.zeros(3, 2)
    for (axis, sign), value in FACE_AMBIENT.items():
        ambient_table[axis, 1 if sign > 0 else 0] = value
    ambient = ambient_table[axes, face_positive.long()]
    base = box_colours[safe_ids] if len(lo) else torch.zeros(*t_hit.shape, 3)
    box_colour = base * (ambient + DIFFUSE * n_dot_l * lit)[..., None]

    surface_colour = torch.where(on_ground[..., None], ground_colour, box_colour)
    fog = 1.0 - torch.exp(-(t_hit * length / FOG_DISTANCE).square())
    surface_colour = surface_colour + (horizon - surface_colour) * fog[..., None]
    colour = torch.where(surface[..., None], surface_colour, colour)
    return colour.reshape(frames, sample_h, sample_w, 3)


@contextmanager
def _torch_threads(num_threads: int | None):
    previous = torch.get_num_threads()
    if num_threads is None or num_threads == previous:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _chunks(num_frames: int, rays_per_frame: int, max_rays: int):
    per_chunk = max(1, max_rays // max(1, rays_per_frame))
    for start in range(0, num_frames, per_chunk):
        yield slice(start, min(num_frames, start + per_chunk))


def render_frames(
    scene: WorldScene,
    c2w,
    K,
    height: int,
    width: int,
    *,
    supersample: int = 2,
    shadows: bool = True,
    max_rays: int = 1 << 15,
    num_threads: int | None = 1,
) -> np.ndarray:
    """Render ``scene`` from each camera.

    Args:
        scene: the scene.
        c2w: [F, 4, 4] (or [4, 4]) camera-to-world, OpenCV axes (x right, y down, z forward), float64 or anything
            numpy converts.
        K: [3, 3] or [F, 3, 3] pixel intrinsics of any image size (e.g. ``camera.POSE_STRING_K``); read as
            normalised focal lengths fx / (2 cx), fy / (2 cy) with the principal point at the image centre.
        height, width: output size in pixels.
        supersample: samples per pixel along each axis (2 -> 4 samples per pixel).
        shadows: cast the boxes' shadows.
        max_rays: frames are traced in chunks of at most this many samples (at least one frame per chunk). Small
            chunks bound memory and let boxes outside every view of a chunk be skipped; no effect on pixels.
        num_threads: torch intra-op threads while rendering (restored afterwards); None = leave as it is. One
            thread is the fastest on a shared CPU: the work is many small element-wise ops (2 threads on 2 busy
            cores were measured 10-50x slower).
    Returns:
        uint8 numpy [F, height, width, 3].
    """
    if height < 1 or width < 1 or supersample < 1:
        raise ValueError(f"height, width and supersample must be >= 1, got {height}, {width}, {supersample}")
    cameras = _as_cameras(c2w)
    num_frames = cameras.shape[0]
    fx, fy = _focal_lengths(K, num_frames, height, width)
    out = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    samples = supersample
    with _torch_threads(num_threads):
        _render_into(out, scene, cameras, fx, fy, height, width, samples, shadows, max_rays)
    return out


def _render_into(out, scene, cameras, fx, fy, height, width, samples, shadows, max_rays) -> None:
    num_frames = cameras.shape[0]
    for part in _chunks(num_frames, height * width * samples * samples, max_rays):
        colour = _trace(
            scene, cameras[part, :3, :3], cameras[part, :3, 3], fx[part], fy[part], height, width, samples, shadows
        )
        grid = colour.reshape(colour.shape[0], height, samples, width, samples, 3)
        total = torch.zeros(colour.shape[0], height, width, 3)
        for a in range(samples):  # fixed summation order
            for b in range(samples):
                total = total + grid[:, :, a, :, b, :]
        mean = total / (samples * samples)
        out[part] = torch.floor(mean.clamp(0.0, 1.0) * 255.0 + 0.5).to(torch.uint8).numpy()


def object_ids(scene: WorldScene, c2w, K, height: int, width: int) -> np.ndarray:
    """int64 [F, height, width]: index into ``scene.boxes`` of the box seen at each pixel centre, -1 for ground or
    sky (same cameras and intrinsics as ``render_frames``)."""
    cameras = _as_cameras(c2w)
    fx, fy = _focal_lengths(K, cameras.shape[0], height, width)
    with _torch_threads(1):
        ids = _trace(scene, cameras[:, :3, :3], cameras[:, :3, 3], fx, fy, height, width, 1, False, want_ids=True)
    return ids.numpy()


def contact_sheet(frames: np.ndarray, indices, scale: int = 4, gap: int = 2) -> np.ndarray:
    """uint8 [H * scale, n * W * scale + gaps, 3]: the frames ``indices`` of ``frames`` [F, H, W, 3] side by side,
    upscaled by nearest neighbour, separated by black gaps of ``gap`` pixels."""
    tiles = []
    for position, index in enumerate(indices):
        tile = np.asarray(frames[index]).repeat(scale, axis=0).repeat(scale, axis=1)
        tiles.append(tile)
        if gap and position < len(indices) - 1:
            tiles.append(np.zeros((tile.shape[0], gap, 3), dtype=np.uint8))
    return np.concatenate(tiles, axis=1)
