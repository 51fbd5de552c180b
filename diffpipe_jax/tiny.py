"""What every family's tiny models and the embedded default share (no weights can be downloaded):
tokenizers that need no vocabulary files, weight randomisation, and a synthetic captioned image
set. The tiny models themselves are each family's (`encoders/<family>.py`).

Every weight is random, norms and the final modulation included, so that a conversion which
drops, transposes or swaps anything shows up as a mismatch.
"""
import os

import numpy as np

from diffpipe_jax import family as family_lib, media

# Where `generate_tiny` writes the embedded default, and only there: a user's path that does not
# exist is an error, never a place to write random data into.
ROOT = "runs/tiny"
IMAGES = f"{ROOT}/images"
VIDEOS = f"{ROOT}/videos"
EVAL_IMAGES = f"{ROOT}/eval_images"


def pipeline_dir(model_type: str, kind: str = "") -> str:
  """Where the embedded default's tiny pipeline of `kind` (one of its `TorchSide.tiny_kinds`) is."""
  return f"{ROOT}/{model_type.replace('-', '_')}{'_' + kind if kind else ''}_pipeline"


def pipeline_kinds(family) -> dict:
  """{folder: kind} of the family's tiny pipelines (`pipeline_dir`)."""
  return {pipeline_dir(family.type, kind): kind for kind in family_lib.torch_side(family).tiny_kinds}


def generates(config, path: str) -> bool:
  """Whether the trainer writes the tiny default to `path` (when it is missing)."""
  return config.generate_tiny and (path in (IMAGES, VIDEOS, EVAL_IMAGES) or path in pipeline_kinds(
      family_lib.get(config.model.type)))

def state_dict_numpy(model):
  return {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}


def save_diffusers(model, root, max_shard_size=None):
  """Writes `root/transformer/` (config.json + safetensors, sharded with an index if asked)."""
  kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
  model.save_pretrained(os.path.join(root, "transformer"), safe_serialization=True, **kw)
  return root


def clip_tokenizer():
  """A byte-level CLIP tokenizer without merges: every byte is a token, as the hub one falls back to."""
  from tokenizers import pre_tokenizers
  from transformers import CLIPTokenizer
  chars = sorted(pre_tokenizers.ByteLevel.alphabet())
  tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
  return CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[], model_max_length=77)


def t5_tokenizer():
  """A character-level T5 tokenizer (Unigram + Metaspace, `</s>` appended) with T5's special ids."""
  import string
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
  from transformers import T5TokenizerFast
  pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
  pieces += [(c, -2.0) for c in string.ascii_letters + string.digits + string.punctuation]
  model = Tokenizer(models.Unigram(pieces, unk_id=2))
  model.pre_tokenizer = pre_tokenizers.Metaspace()
  model.decoder = decoders.Metaspace()
  model.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A $B </s>",
                                                       special_tokens=[("</s>", 1)])
  return T5TokenizerFast(tokenizer_object=model, eos_token="</s>", unk_token="<unk>",
                         pad_token="<pad>", extra_ids=0, model_max_length=512)


LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>")


def llama_tokenizer():
  """A byte-level BPE tokenizer with LLaMA-3's special tokens, `<|begin_of_text|>` prepended
  and right padding. One merge, `{}`, which LLaMA-3 also has as one token: its prompt templates'
  placeholder then counts as one, as diffusers assumes. Loads as transformers'
  `PreTrainedTokenizerFast`, as the real one does."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
  from transformers import PreTrainedTokenizerFast
  chars = sorted(pre_tokenizers.ByteLevel.alphabet())
  model = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(chars + ["{}"])},
                               merges=[("{", "}")]))
  model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  model.decoder = decoders.ByteLevel()
  model.add_special_tokens(list(LLAMA3_SPECIAL))
  bos = LLAMA3_SPECIAL[0]
  model.post_processor = processors.TemplateProcessing(
      single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, model.token_to_id(bos))])
  return PreTrainedTokenizerFast(tokenizer_object=model, bos_token=bos, eos_token="<|end_of_text|>",
                                 pad_token="<|end_of_text|>", padding_side="right",
                                 model_max_length=8192)


def t5_config(config_class, tokenizer, d_model, **config):
  """A small T5 v1.1-style config (gated GELU) of width `d_model` over `tokenizer`'s ids
  (`t5_tokenizer`), for T5 and UMT5 alike."""
  return config_class(**{**dict(
      vocab_size=len(tokenizer), pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
      d_model=d_model, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
      feed_forward_proj="gated-gelu"), **config})


def t5_encoder(tokenizer, d_model):
  """A random T5 v1.1 encoder (gated GELU, as FLUX.1's and LTX-Video's T5-XXL) of width
  `d_model` over `tokenizer`'s ids (`t5_tokenizer`)."""
  from transformers import T5Config, T5EncoderModel
  return randomize_(T5EncoderModel(t5_config(T5Config, tokenizer, d_model)).eval())


def umt5_encoder(tokenizer, d_model, seed=0):
  """A random UMT5 encoder (Wan's UMT5-XXL: a relative attention bias in every layer, not only
  the first as T5's) of width `d_model` over `tokenizer`'s ids, with an odd head count (3 x 8,
  unlike `d_model`) and three layers."""
  from transformers import UMT5Config, UMT5EncoderModel
  return build(UMT5EncoderModel, seed, t5_config(UMT5Config, tokenizer, d_model, num_heads=3,
                                                 num_layers=3))


def build(cls, seed, *args, **kwargs):
  """A random `cls(*args, **kwargs)` (a torch module, eval mode) from `seed`: torch's init, then
  `randomize_`."""
  import torch
  torch.manual_seed(seed)
  return randomize_(cls(*args, **kwargs).eval())


def randomize_(model, scale=0.2):
  """Adds noise to every parameter (norms included) so that no weight is at its trivial init."""
  import torch
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * scale)
  return model


COLOURS = ("red", "green", "blue", "yellow")

# The tiny video set: (extension, width, height, frames, fps): both containers, sizes that are
# and are not multiples of 32, frame counts that are and are not 1 + 8k, several frame rates.
# At 64 pixels, frame buckets (1, 9, 17) and 25 fps, the clips and images fill three buckets of
# four (64x64x17, 96x64x9, 96x64x1): 3 steps an epoch at the tiny variants' global batch of 4.
VIDEO_CLIPS = (("mp4", 64, 64, 17, 24), ("webm", 96, 64, 9, 25), ("mp4", 70, 50, 20, 30),
               ("webm", 64, 64, 25, 30), ("mp4", 96, 64, 9, 24), ("webm", 70, 50, 12, 25),
               ("webm", 60, 60, 20, 25), ("mp4", 64, 64, 18, 24))
VIDEO_SET_IMAGES = ((96, 64), (70, 50), (120, 80), (90, 60))


def pattern(i, width, height, t=0.0):
  """Smooth colour field number i (uint8 [H, W, 3]), tinted by colour i; t (in frames) moves it."""
  y, x = np.mgrid[0:height, 0:width] / max(width, height)
  rgb = np.stack([np.sin(6 * (x - 0.04 * t) + i), np.cos(5 * (y + 0.03 * t) - i),
                  np.sin(4 * (x + y) + 0.1 * t)], -1) * 0.3 + 0.5
  rgb[..., i % len(COLOURS) % 3] += 0.2
  return (np.clip(rgb, 0, 1) * 255).astype(np.uint8)


def write_captioned_image(folder, stem, pixels, caption):
  from PIL import Image
  Image.fromarray(pixels).save(os.path.join(folder, f"{stem}.png"))
  write_caption(folder, stem, caption)


def write_caption(folder, stem, caption):
  with open(os.path.join(folder, f"{stem}.txt"), "w") as f:
    f.write(caption)


def write_image_dataset(folder, num_images=12, sizes=((40, 40), (56, 32), (32, 56))):
  """Captioned synthetic images (smooth colour fields of a few aspect ratios) with same-stem
  .txt captions: the embedded default's dataset. Returns folder."""
  os.makedirs(folder, exist_ok=True)
  for i in range(num_images):
    w, h = sizes[i % len(sizes)]
    write_captioned_image(folder, f"{i:03d}", pattern(i, w, h),
                          f"a {COLOURS[i % len(COLOURS)]} pattern, number {i}")
  return folder


def write_video_dataset(folder, clips=VIDEO_CLIPS, image_sizes=VIDEO_SET_IMAGES):
  """Captioned synthetic clips (moving colour fields, `VIDEO_CLIPS`) and a few images, with
  same-stem .txt captions: the embedded default's dataset of the video families. Returns folder."""
  os.makedirs(folder, exist_ok=True)
  for i, (ext, w, h, frames, fps) in enumerate(clips):
    media.write_video(os.path.join(folder, f"clip{i:03d}.{ext}"),
                np.stack([pattern(i, w, h, t) for t in range(frames)]), fps)
    write_caption(folder, f"clip{i:03d}", f"a {COLOURS[i % len(COLOURS)]} pattern drifting, "
                                          f"clip {i}")
  for i, (w, h) in enumerate(image_sizes):
    write_captioned_image(folder, f"image{i:03d}", pattern(i, w, h),
                          f"a still {COLOURS[i % len(COLOURS)]} pattern, number {i}")
  return folder


def checkpoint_path(config, family) -> str:
  """The transformer's checkpoint path, after `generate_tiny` wrote the missing pieces of the
  tiny default (the family's pipeline, the image and video sets) to their default paths only."""
  path = family.checkpoint_path(config.model)
  if generates(config, path) and not os.path.isfile(os.path.join(path, "model_index.json")):
    kind = pipeline_kinds(family).get(path, "")
    print(f"writing the embedded tiny {family.type}{' ' + kind if kind else ''} pipeline to {path}")
    family_lib.torch_side(family).write_tiny_pipeline(path, **({"kind": kind} if kind else {}))
  eval_sets = dict(sizes=((40, 40),), num_images=4)
  for folder, options in [(config.dataset.path, {})] + [(e.get("path", ""), eval_sets)
                                                         for e in config.eval_datasets.values()]:
    if generates(config, folder) and not os.path.isdir(folder):
      videos = folder == VIDEOS
      print(f"writing the embedded tiny {'video' if videos else 'image'} set to {folder}")
      (write_video_dataset if videos else write_image_dataset)(folder, **options)
  return path
