"""Camera trajectories: pose JSON -> Teacher camera/action inputs, and pose strings.

Pose JSON formats (both are objects whose keys are the frame numbers "0", "1", ... as strings):
* **inference** (upstream ``assets/pose/*.json`` and ``pose_string_to_json``): one key per LATENT frame, each with
  ``"extrinsic"`` (4x4 camera-to-world) and ``"K"`` (3x3 pixel intrinsics). The number of keys must equal the number
  of latents. Poses are used as they are (not re-centred).
* **training** (upstream trainer records): one key per VIDEO frame, each with ``"w2c"`` (4x4 world-to-camera) and
  ``"intrinsic"`` (3x3 pixel intrinsics). Latent i uses frame 4i; when fewer latents are requested than the file
  covers, the first ones are taken. The selected poses are re-centred so that latent 0 is the identity.

Model inputs (``pose_to_input``), per latent frame:
* ``viewmats`` [T, 4, 4] float64, world-to-camera;
* ``Ks`` [T, 3, 3] float64, normalised ``[[fx/(2cx), 0, 0.5], [0, fy/(2cy), 0.5], [0, 0, 1]]``;
* ``action`` [T] int64 in 0..80 = translation_label * 9 + rotation_label, from the motion between consecutive latents
  (frame 0 is 0). Translation code [forward, backward, right, left] from the angle of the relative translation to the
  +z / +x axes (< 60 deg or > 120 deg), only when its length exceeds the move threshold (1e-4 for inference files,
  0.01 in the upstream trainer). Rotation code [yaw right, yaw left, pitch up, pitch down] from the "xyz" Euler angles
  of the relative rotation (b = asin(-R[2,0]), a = atan2(R[2,1], R[2,2])) with a 0.05 deg threshold.

Memory retrieval (``select_aligned_memory_frames``, the AR loop's context): rollout/memory_retrieval.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from predictor_training.runtime.errors import UserInputError

# ---- constants (upstream values) ----------------------------------------------------------------------------
INFERENCE_MOVE_THRESHOLD = 1e-4  # min |translation| between latents that counts as a move, inference pose files
TRAINING_MOVE_THRESHOLD = 0.01  # same threshold in the upstream trainer
ROTATION_THRESHOLD_DEG = 0.05
FRAMES_PER_LATENT = 4  # training pose files: latent i <- video frame 4i

POSE_STRING_STEP = 0.08  # units per latent for w/s/a/d
POSE_STRING_ANGLE_DEG = 3.0  # degrees per latent for left/right/up/down
POSE_STRING_K = [[969.6969696969696, 0.0, 960.0], [0.0, 969.6969696969696, 540.0], [0.0, 0.0, 1.0]]

# 4-bit one-hot code -> label 0..8 (only these combinations can occur: at most one bit of each opposite pair)
_CODE_TO_LABEL = {
    (0, 0, 0, 0): 0,
    (1, 0, 0, 0): 1,
    (0, 1, 0, 0): 2,
    (0, 0, 1, 0): 3,
    (0, 0, 0, 1): 4,
    (1, 0, 1, 0): 5,
    (1, 0, 0, 1): 6,
    (0, 1, 1, 0): 7,
    (0, 1, 0, 1): 8,
}

# pose-string command -> (motion field, sign)
_POSE_STRING_COMMANDS = {
    "w": ("forward", 1.0),
    "s": ("forward", -1.0),
    "d": ("right", 1.0),
    "a": ("right", -1.0),
    "right": ("yaw", 1.0),
    "left": ("yaw", -1.0),
    "up": ("pitch", 1.0),
    "down": ("pitch", -1.0),
}

_FORMAT_FIELDS = {"inference": ("extrinsic", "K"), "training": ("w2c", "intrinsic")}
_FORMAT_MOVE_THRESHOLD = {"inference": INFERENCE_MOVE_THRESHOLD, "training": TRAINING_MOVE_THRESHOLD}


class PoseError(UserInputError):
    """A pose JSON (or pose string) that cannot be used; the message names the file, key and field."""


@dataclass(frozen=True)
class PoseSequence:
    """Per-latent cameras loaded from a pose JSON.

    Attributes:
        w2c: [T, 4, 4] float64 world-to-camera (inverse of ``extrinsic``, or the re-centred training ``w2c``).
        intrinsics: [T, 3, 3] float64 pixel intrinsics.
        pose_format: "inference" or "training".
        source: file path, or "<dict>" for an in-memory pose JSON.
    """

    w2c: np.ndarray
    intrinsics: np.ndarray
    pose_format: str
    source: str

    @property
    def num_latents(self) -> int:
        return int(self.w2c.shape[0])

    @property
    def default_move_threshold(self) -> float:
        """The upstream translation threshold for this format (1e-4 inference, 0.01 training)."""
        return _FORMAT_MOVE_THRESHOLD[self.pose_format]


# =============================================================================================================
# Pose JSON loading
# =============================================================================================================
def load_pose(path_or_dict: str | Path | Mapping, num_latents: int | None = None) -> PoseSequence:
    """Read an inference- or training-format pose JSON (see module docstring).

    Args:
        path_or_dict: path to the JSON file, or the parsed JSON object.
        num_latents: expected number of latents; None = every latent the file describes.
    Raises:
        PoseError naming the file, key and field on any malformed or missing entry, or a latent-count mismatch.
    """
    # 1. read
    if isinstance(path_or_dict, Mapping):
        data, source = path_or_dict, "<dict>"
    elif isinstance(path_or_dict, (str, Path)):
        source = str(path_or_dict)
        try:
            with open(path_or_dict, encoding="utf-8") as handle:
                data = json.load(handle)
        except FileNotFoundError:
            raise PoseError(f"pose file {source} does not exist") from None
        except json.JSONDecodeError as error:
            raise PoseError(f"pose file {source} is not valid JSON: {error}") from None
    else:
        raise TypeError(f"expected a pose JSON path or dict, got {type(path_or_dict).__name__}")
    if not isinstance(data, Mapping) or not data:
        raise PoseError(f"pose file {source}: expected a non-empty JSON object with keys '0', '1', ...")
    if num_latents is not None and (not isinstance(num_latents, int) or num_latents < 1):
        raise ValueError(f"num_latents must be a positive int or None, got {num_latents!r}")

    # 2. frame keys, then the format from the fields of frame "0"
    frame_keys = _ordered_frame_keys(data, source)
    pose_format = _detect_format(data["0"], source)
    matrix_field, k_field = _FORMAT_FIELDS[pose_format]

    # 3. which frames are latents
    if pose_format == "inference":
        if num_latents is not None and len(frame_keys) != num_latents:
            raise PoseError(
                f"pose file {source}: has {len(frame_keys)} latent keys ('0'..'{len(frame_keys) - 1}'), "
                f"expected num_latents={num_latents} (one key per latent frame)"
            )
        latent_keys = frame_keys
    else:
        available = (len(frame_keys) - 1) // FRAMES_PER_LATENT + 1
        wanted = available if num_latents is None else num_latents
        if wanted > available:
            raise PoseError(
                f"pose file {source}: {len(frame_keys)} video-frame keys cover {available} latents "
                f"(latent i = frame {FRAMES_PER_LATENT}i), expected num_latents={wanted}, which needs at least "
                f"{FRAMES_PER_LATENT * (wanted - 1) + 1} frame keys"
            )
        latent_keys = [frame_keys[FRAMES_PER_LATENT * i] for i in range(wanted)]

    # 4. matrices
    matrices = np.stack([_read_matrix(data, key, matrix_field, 4, source) for key in latent_keys])
    intrinsics = np.stack([_read_matrix(data, key, k_field, 3, source) for key in latent_keys])
    for key, pixel_k in zip(latent_keys, intrinsics):
        if not (pixel_k[0, 2] > 0 and pixel_k[1, 2] > 0):
            raise PoseError(
                f"pose file {source}: key '{key}' field '{k_field}' has principal point "
                f"({pixel_k[0, 2]}, {pixel_k[1, 2]}); expected cx > 0 and cy > 0 (pixel intrinsics)"
            )
    try:
        if pose_format == "inference":
            w2c = np.stack([np.linalg.inv(c2w) for c2w in matrices])
        else:
            w2c = recenter_w2c(matrices)
    except np.linalg.LinAlgError:
        raise PoseError(f"pose file {source}: field '{matrix_field}' holds a singular matrix") from None
    return PoseSequence(w2c=w2c, intrinsics=intrinsics, pose_format=pose_format, source=source)


def recenter_w2c(w2c: np.ndarray) -> np.ndarray:
    """Express every camera relative to camera 0, so that the result's frame 0 is the identity.

    Args:
        w2c: [T, 4, 4] float64 world-to-camera.
    Returns:
        [T, 4, 4] float64 world-to-camera in camera 0's frame.
    """
    c2w = np.linalg.inv(w2c)
    first_w2c = np.linalg.inv(c2w[0])
    return np.linalg.inv(np.stack([first_w2c @ camera for camera in c2w]))


def _ordered_frame_keys(data: Mapping, source: str) -> list[str]:
    """The keys "0".."N-1" in numeric order; raises on a non-integer or a missing key."""
    numbers = []
    for key in data:
        if not (isinstance(key, str) and key.isdigit() and str(int(key)) == key):
            raise PoseError(f"pose file {source}: key {key!r} is not a frame number; expected keys '0', '1', ...")
        numbers.append(int(key))
    present = set(numbers)
    for number in range(len(numbers)):
        if number not in present:
            raise PoseError(
                f"pose file {source}: missing key '{number}' (expected keys '0'..'{len(numbers) - 1}', "
                f"found up to '{max(numbers)}')"
            )
    return [str(number) for number in range(len(numbers))]


def _detect_format(first_entry, source: str) -> str:
    if not isinstance(first_entry, Mapping):
        raise PoseError(f"pose file {source}: key '0' must hold an object, got {type(first_entry).__name__}")
    if "extrinsic" in first_entry:
        return "inference"
    if "w2c" in first_entry:
        return "training"
    raise PoseError(
        f"pose file {source}: key '0' has fields {sorted(first_entry)}; expected 'extrinsic' + 'K' "
        "(inference format) or 'w2c' + 'intrinsic' (training format)"
    )


def _read_matrix(data: Mapping, key: str, field: str, size: int, source: str) -> np.ndarray:
    entry = data[key]
    if not isinstance(entry, Mapping):
        raise PoseError(f"pose file {source}: key '{key}' must hold an object, got {type(entry).__name__}")
    if field not in entry:
        raise PoseError(f"pose file {source}: key '{key}' is missing field '{field}' ({size}x{size} matrix)")
    try:
        matrix = np.array(entry[field], dtype=np.float64)
    except (TypeError, ValueError):
        raise PoseError(
            f"pose file {source}: key '{key}' field '{field}' is not a {size}x{size} number matrix"
        ) from None
    if matrix.shape != (size, size) or not np.isfinite(matrix).all():
        raise PoseError(
            f"pose file {source}: key '{key}' field '{field}' must be a finite {size}x{size} matrix, "
            f"got shape {matrix.shape}"
        )
    return matrix


# =============================================================================================================
# Pose -> model inputs
# =============================================================================================================
def pose_to_input(
    pose: PoseSequence | str | Path | Mapping,
    num_latents: int | None = None,
    move_threshold: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Convert a pose JSON (or a loaded ``PoseSequence``) to the Teacher's camera and action inputs.

    Args:
        pose: ``PoseSequence``, pose JSON path, or parsed pose JSON.
        num_latents: expected number of latents (None = all in the file).
        move_threshold: minimum relative translation length that counts as a move. None = the format's upstream
            value (``INFERENCE_MOVE_THRESHOLD`` = 1e-4 or ``TRAINING_MOVE_THRESHOLD`` = 0.01).
    Returns:
        viewmats [T, 4, 4] float64 (w2c), Ks [T, 3, 3] float64 (normalised), action [T] int64 (0..80).
        The caller adds the batch dimension.
    """
    if not isinstance(pose, PoseSequence):
        pose = load_pose(pose, num_latents)
    elif num_latents is not None and pose.num_latents != num_latents:
        raise PoseError(
            f"pose file {pose.source}: has {pose.num_latents} latents, expected num_latents={num_latents}"
        )
    threshold = pose.default_move_threshold if move_threshold is None else float(move_threshold)
    viewmats = torch.from_numpy(pose.w2c.copy())
    ks = torch.from_numpy(normalize_intrinsics(pose.intrinsics))
    action = torch.from_numpy(action_labels(pose.w2c, threshold))
    return viewmats, ks, action


def normalize_intrinsics(pixel_k: np.ndarray) -> np.ndarray:
    """[T, 3, 3] pixel K -> [T, 3, 3] with fx/(2cx), fy/(2cy) and a principal point of 0.5 (float64)."""
    ks = np.array(pixel_k, dtype=np.float64)
    ks[:, 0, 0] /= ks[:, 0, 2] * 2
    ks[:, 1, 1] /= ks[:, 1, 2] * 2
    ks[:, 0, 2] = 0.5
    ks[:, 1, 2] = 0.5
    return ks


def action_labels(
    w2c: np.ndarray, move_threshold: float, rotation_threshold_deg: float = ROTATION_THRESHOLD_DEG
) -> np.ndarray:
    """Discrete action per latent from the relative motion between consecutive cameras.

    Args:
        w2c: [T, 4, 4] float64 world-to-camera.
        move_threshold: translation length above which a move is labelled.
        rotation_threshold_deg: Euler angle (degrees) above which a yaw / pitch is labelled.
    Returns:
        [T] int64, ``translation_label * 9 + rotation_label``; frame 0 is 0.
    """
    c2w = np.linalg.inv(w2c)
    relative = np.linalg.inv(c2w[:-1]) @ c2w[1:]  # camera i in the frame of camera i-1
    labels = np.zeros(w2c.shape[0], dtype=np.int64)
    for i, motion in enumerate(relative, start=1):
        translation = _translation_code(motion[:3, 3], move_threshold)
        rotation = _rotation_code(motion[:3, :3], rotation_threshold_deg)
        labels[i] = _CODE_TO_LABEL[translation] * 9 + _CODE_TO_LABEL[rotation]
    return labels


def _translation_code(translation: np.ndarray, move_threshold: float) -> tuple[int, int, int, int]:
    """[forward, backward, right, left] from the direction of a camera-local translation."""
    length = np.linalg.norm(translation)
    if not length > move_threshold:
        return (0, 0, 0, 0)
    angles_deg = np.arccos((translation / length).clip(-1.0, 1.0)) * (180.0 / math.pi)
    forward, backward = int(angles_deg[2] < 60), int(angles_deg[2] > 120)
    right, left = int(angles_deg[0] < 60), int(angles_deg[0] > 120)
    return (forward, backward, right, left)


def _rotation_code(rotation: np.ndarray, threshold_deg: float) -> tuple[int, int, int, int]:
    """[yaw right, yaw left, pitch up, pitch down] from R = Rz(c) Ry(b) Rx(a) (extrinsic "xyz" Euler angles)."""
    yaw_deg = math.degrees(math.asin(min(1.0, max(-1.0, -rotation[2, 0]))))
    pitch_deg = math.degrees(math.atan2(rotation[2, 1], rotation[2, 2]))
    return (
        int(yaw_deg > threshold_deg),
        int(yaw_deg < -threshold_deg),
        int(pitch_deg > threshold_deg),
        int(pitch_deg < -threshold_deg),
    )


# =============================================================================================================
# Pose strings
# =============================================================================================================
def parse_pose_string(pose_string: str) -> list[dict[str, float]]:
    """Parse "w-3, right-4, w+left-31" into one motion dict per latent step.

    Each comma-separated command is ``name-count``: ``count`` (a non-negative integer) steps of the motion ``name``.
    ``name`` is one of w/s (forward/backward 0.08), d/a (right/left 0.08), right/left (yaw +-3 deg), up/down
    (pitch +-3 deg), or several of them joined by ``+`` (all applied in the same step, e.g. ``w+left``).
    Returns dicts with keys among "yaw", "pitch" (radians), "forward", "right" (units).
    """
    if not isinstance(pose_string, str):
        raise TypeError(f"pose_string must be a str, got {type(pose_string).__name__}")
    motions: list[dict[str, float]] = []
    for command in (part.strip() for part in pose_string.split(",")):
        if not command:
            continue
        pieces = command.split("-")
        if len(pieces) != 2:
            raise PoseError(f"pose string command {command!r}: expected 'name-count', e.g. 'w-31' or 'w+left-31'")
        names, count_text = pieces[0].strip(), pieces[1].strip()
        if not count_text.isdigit():
            raise PoseError(f"pose string command {command!r}: count {count_text!r} must be a non-negative integer")
        step: dict[str, float] = {}
        for name in (token.strip() for token in names.split("+")):
            if name not in _POSE_STRING_COMMANDS:
                raise PoseError(
                    f"pose string command {command!r}: unknown motion {name!r}; expected one of "
                    f"{sorted(_POSE_STRING_COMMANDS)} (combine with '+')"
                )
            field, sign = _POSE_STRING_COMMANDS[name]
            if field in step:
                raise PoseError(f"pose string command {command!r}: sets {field!r} twice")
            if field in ("yaw", "pitch"):
                step[field] = sign * np.deg2rad(POSE_STRING_ANGLE_DEG)
            else:
                step[field] = sign * POSE_STRING_STEP
        motions.extend(dict(step) for _ in range(int(count_text)))
    return motions


def camera_trajectory_from_motions(motions: Sequence[Mapping[str, float]]) -> list[np.ndarray]:
    """Integrate per-step motions from the identity: [1 + len(motions)] camera-to-world 4x4 float64 matrices.

    Within a step: yaw (R <- R @ Ry), then pitch (R <- R @ Rx), then the forward (+z) and right (+x) moves, each
    along the current camera axes (t <- t + R @ offset).
    """
    camera = np.eye(4)
    poses = [camera.copy()]
    for motion in motions:
        if "yaw" in motion:
            camera[:3, :3] = camera[:3, :3] @ _rotation_y(motion["yaw"])
        if "pitch" in motion:
            camera[:3, :3] = camera[:3, :3] @ _rotation_x(motion["pitch"])
        forward = motion.get("forward", 0.0)  # absent key = no move, by the motion-dict format
        if forward != 0:
            camera[:3, 3] += camera[:3, :3] @ np.array([0.0, 0.0, forward])
        right = motion.get("right", 0.0)
        if right != 0:
            camera[:3, 3] += camera[:3, :3] @ np.array([right, 0.0, 0.0])
        poses.append(camera.copy())
    return poses


def pose_string_to_json(pose_string: str) -> dict:
    """Inference-format pose JSON ({"0": {"extrinsic", "K"}, ...}) for a pose string; 1 + steps latents."""
    poses = camera_trajectory_from_motions(parse_pose_string(pose_string))
    return {
        str(index): {"extrinsic": camera.tolist(), "K": [list(row) for row in POSE_STRING_K]}
        for index, camera in enumerate(poses)
    }


def _rotation_x(angle: float) -> np.ndarray:
    c, s = np.cos(angle), np.sin(angle)
    return np.array([[1, 0, 0], [0, c, -s], [0, s, c]])


def _rotation_y(angle: float) -> np.ndarray:
    c, s = np.cos(angle), np.sin(angle)
    return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])
