"""What every family's tiny models and the embedded default share (no weights can be downloaded):
tokenizers that need no vocabulary files, weight randomisation, and a synthetic captioned image
set. The tiny models themselves are each family's (`encoders/<family>.py`).

Every weight is random, norms and the final modulation included, so that a conversion which
drops, transposes or swaps anything shows up as a mismatch.
"""
import os

import numpy as np

def state_dict_numpy(model):
  return {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}


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


def randomize_(model, scale=0.2):
  """Adds noise to every parameter (norms included) so that no weight is at its trivial init."""
  import torch
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * scale)
  return model


def write_image_dataset(folder, num_images=12, sizes=((40, 40), (56, 32), (32, 56))):
  """Captioned synthetic images (smooth colour fields of a few aspect ratios) with same-stem
  .txt captions: the embedded default's dataset. Returns folder."""
  from PIL import Image
  os.makedirs(folder, exist_ok=True)
  colours = ["red", "green", "blue", "yellow"]
  for i in range(num_images):
    w, h = sizes[i % len(sizes)]
    y, x = np.mgrid[0:h, 0:w] / max(w, h)
    c = i % len(colours)
    rgb = np.stack([np.sin(6 * x + i), np.cos(5 * y - i), np.sin(4 * (x + y))], -1) * 0.3 + 0.5
    rgb[..., c % 3] += 0.2
    Image.fromarray((np.clip(rgb, 0, 1) * 255).astype(np.uint8)).save(os.path.join(folder, f"{i:03d}.png"))
    with open(os.path.join(folder, f"{i:03d}.txt"), "w") as f:
      f.write(f"a {colours[c]} pattern, number {i}")
  return folder
