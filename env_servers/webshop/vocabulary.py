"""The word lists the catalog generator draws from: categories, product types, attributes, options.

WebShop's real catalog has five top-level categories (beauty, food, fashion, furniture,
electronics) scraped from Amazon; this table mirrors that shape with 30 product types.
Each `ProductType` fixes what WebShop's reward compares: the search `query` and the
`product_category` path (both used by the type factor), the attribute vocabulary (goal
attributes are drawn from it), the option groups (size/color/flavor/...) and a price
distribution (log-normal around a median).

The reward matches strings fuzzily (`token_set_ratio > 85`) and by substring, so the
vocabulary must keep distinct values apart: no two attributes of a type, and no two
values of an option group, may fuzzy-match each other, and none may be a substring of
another (size values are compared exactly, so they only need to differ). `vocabulary_conflicts()` checks this; a test keeps it empty.
"""

from __future__ import annotations

import dataclasses

from env_servers.webshop import reward

CATEGORIES = ("beauty", "food", "fashion", "furniture", "electronics")


@dataclasses.dataclass(frozen=True)
class ProductType:
  """One kind of product.

  Attributes:
    name: the product type, e.g. "shampoo" (what the type factor of the reward compares).
    category: one of `CATEGORIES` (reported as info["task_type"]).
    query: WebShop's per-product search query field (type factor: exact match).
    path: WebShop's `product_category`, levels joined by " › ".
    nouns: title nouns; the first is the canonical one, all contain `name`'s last token
      so a title always names the type.
    attributes: attribute vocabulary (WebShop's `Attributes`).
    options: option groups, name -> values; a product offers a subset of each group.
    price_median: median price in dollars; `price_sigma`: log-normal spread.
  """

  name: str
  category: str
  query: str
  path: str
  nouns: tuple[str, ...]
  attributes: tuple[str, ...]
  options: tuple[tuple[str, tuple[str, ...]], ...]
  price_median: float
  price_sigma: float = 0.35


def _t(name, category, query, path, nouns, attributes, options, price_median, price_sigma=0.35):
  return ProductType(name, category, query, path, tuple(nouns), tuple(attributes),
                     tuple((k, tuple(v)) for k, v in options.items()), price_median, price_sigma)


_HAIR = "beauty & personal care › hair care"
_SKIN = "beauty & personal care › skin care"
_GROCERY = "grocery & gourmet food"
_CLOTHING = "clothing, shoes & jewelry"
_HOME = "home & kitchen › furniture"
_ELEC = "electronics"

_BEAUTY_COLORS = ["natural beige", "ivory", "espresso", "honey", "porcelain", "caramel"]
_APPAREL_COLORS = ["black", "white", "navy", "heather grey", "olive", "burgundy", "khaki", "teal"]
_FURNITURE_COLORS = ["walnut", "espresso", "white", "black", "oak", "grey"]
_DEVICE_COLORS = ["black", "white", "silver", "rose gold", "midnight green", "coral"]

PRODUCT_TYPES: tuple[ProductType, ...] = (
    # --- beauty -----------------------------------------------------------------------
    _t("shampoo", "beauty", "shampoo", f"{_HAIR} › shampoo & conditioner › shampoos",
       ["shampoo", "clarifying shampoo", "daily shampoo"],
       ["sulfate free", "paraben free", "for dry hair", "cruelty free", "color safe",
        "natural ingredients", "anti dandruff", "tea tree oil"],
       {"size": ["8 fl oz", "12 fl oz", "16 fl oz", "33.8 fl oz"],
        "scent": ["lavender", "coconut", "unscented", "eucalyptus", "citrus"]}, 14.0),
    _t("conditioner", "beauty", "conditioner", f"{_HAIR} › shampoo & conditioner › conditioners",
       ["conditioner", "leave-in conditioner", "deep conditioner"],
       ["sulfate free", "paraben free", "for curly hair", "cruelty free", "argan oil",
        "vegan formula", "color safe", "detangling"],
       {"size": ["8 fl oz", "12 fl oz", "16 fl oz", "33.8 fl oz"],
        "scent": ["lavender", "coconut", "unscented", "rosemary mint", "vanilla"]}, 15.0),
    _t("face moisturizer", "beauty", "face moisturizer", f"{_SKIN} › face › moisturizers",
       ["face moisturizer", "daily face moisturizer", "hydrating face moisturizer"],
       ["hyaluronic acid", "fragrance free", "oil free", "for sensitive skin", "spf 30",
        "non comedogenic", "vitamin c", "dermatologist tested"],
       {"size": ["1.7 fl oz", "2.5 fl oz", "3.4 fl oz"]}, 22.0),
    _t("lipstick", "beauty", "lipstick", "beauty & personal care › makeup › lips › lipstick",
       ["lipstick", "matte lipstick", "cream lipstick"],
       ["long lasting", "cruelty free", "moisturizing", "highly pigmented", "vegan formula",
        "smudge proof", "paraben free"],
       {"color": ["ruby", "nude pink", "berry", "coral", "mauve", "plum"]}, 11.0),
    _t("foundation", "beauty", "foundation", "beauty & personal care › makeup › face › foundation",
       ["foundation", "liquid foundation", "full coverage foundation"],
       ["long lasting", "oil free", "spf 15", "lightweight", "non comedogenic", "cruelty free",
        "for oily skin"],
       {"color": _BEAUTY_COLORS, "size": ["1 fl oz", "1.5 fl oz"]}, 19.0),
    _t("body lotion", "beauty", "body lotion", f"{_SKIN} › body › lotions",
       ["body lotion", "moisturizing body lotion", "daily body lotion"],
       ["shea butter", "fragrance free", "for dry skin", "non greasy", "natural ingredients",
        "paraben free", "aloe vera"],
       {"size": ["8 fl oz", "16 fl oz", "32 fl oz"],
        "scent": ["lavender", "coconut", "unscented", "cocoa butter", "cucumber melon"]}, 12.0),
    # --- food -------------------------------------------------------------------------
    _t("green tea", "food", "green tea", f"{_GROCERY} › beverages › tea › green",
       ["green tea", "green tea bags", "loose leaf green tea"],
       ["organic", "gluten free", "non gmo", "caffeine free", "individually wrapped",
        "kosher certified", "fair trade"],
       {"flavor": ["jasmine", "peppermint", "original", "lemon ginger", "matcha"],
        "size": ["20 count", "50 count", "100 count"]}, 9.0),
    _t("coffee beans", "food", "coffee beans", f"{_GROCERY} › beverages › coffee › whole bean",
       ["whole bean coffee", "coffee beans", "roasted coffee beans"],
       ["organic", "fair trade", "single origin", "low acid", "kosher certified",
        "small batch roasted", "non gmo"],
       {"flavor": ["dark roast", "medium roast", "espresso roast", "hazelnut", "mocha"],
        "size": ["12 ounce", "2 pound", "5 pound"]}, 16.0),
    _t("protein bar", "food", "protein bar", f"{_GROCERY} › snack foods › bars › protein",
       ["protein bar", "protein bars", "high protein bar"],
       ["gluten free", "low sugar", "keto friendly", "plant based", "non gmo", "high fiber",
        "soy free"],
       {"flavor": ["chocolate peanut butter", "cookies and cream", "salted caramel",
                   "birthday cake", "almond coconut"],
        "size": ["pack of 6", "pack of 12", "pack of 24"]}, 22.0),
    _t("beef jerky", "food", "beef jerky", f"{_GROCERY} › meat & seafood › jerky",
       ["beef jerky", "beef jerky strips", "grass fed jerky"],
       ["grass fed", "high protein", "low sodium", "gluten free", "no added sugar",
        "keto friendly", "nitrate free"],
       {"flavor": ["teriyaki", "original", "peppered", "sweet and spicy", "smoked barbecue"],
        "size": ["2.5 ounce", "10 ounce", "16 ounce"]}, 15.0),
    _t("olive oil", "food", "olive oil", f"{_GROCERY} › pantry › oils › olive",
       ["extra virgin olive oil", "olive oil", "cold pressed olive oil"],
       ["cold pressed", "organic", "non gmo", "kosher certified", "first harvest",
        "single origin", "glass bottle"],
       {"size": ["16.9 fl oz", "25.3 fl oz", "101 fl oz"]}, 18.0),
    _t("dark chocolate", "food", "dark chocolate", f"{_GROCERY} › candy & chocolate › bars",
       ["dark chocolate", "dark chocolate bar", "dark chocolate bars"],
       ["fair trade", "organic", "vegan formula", "dairy free", "low sugar", "non gmo",
        "gluten free"],
       {"flavor": ["sea salt", "raspberry", "orange zest", "almond", "mint crisp"],
        "size": ["pack of 4", "pack of 10", "pack of 20"]}, 13.0),
    # --- fashion ----------------------------------------------------------------------
    _t("running shoes", "fashion", "men's running shoes",
       f"{_CLOTHING} › men › shoes › athletic › running",
       ["running shoes", "road running shoes", "trail running shoes"],
       ["non slip", "lightweight", "breathable mesh", "rubber sole", "arch support",
        "memory foam", "wide toe box"],
       {"size": ["us 8", "us 9", "us 10", "us 11", "us 12"], "color": _APPAREL_COLORS}, 55.0),
    _t("t-shirt", "fashion", "men's t-shirt", f"{_CLOTHING} › men › clothing › shirts › t-shirts",
       ["t-shirt", "crew neck t-shirt", "graphic t-shirt"],
       ["machine wash", "cotton blend", "short sleeve", "moisture wicking", "tagless",
        "relaxed fit", "preshrunk"],
       {"size": ["small", "medium", "x-large", "xx-large"], "color": _APPAREL_COLORS}, 17.0),
    _t("yoga pants", "fashion", "women's yoga pants", f"{_CLOTHING} › women › clothing › active",
       ["yoga pants", "flare yoga pants", "workout leggings"],
       ["high waist", "tummy control", "four way stretch", "squat proof", "side pockets",
        "moisture wicking", "machine wash"],
       {"size": ["small", "medium", "x-large", "xx-large"], "color": _APPAREL_COLORS}, 24.0),
    _t("winter jacket", "fashion", "women's winter jacket",
       f"{_CLOTHING} › women › clothing › coats & jackets",
       ["winter jacket", "puffer jacket", "insulated winter jacket"],
       ["water resistant", "detachable hood", "zip pockets", "fleece lined", "windproof",
        "packable design", "machine wash"],
       {"size": ["small", "medium", "x-large", "xx-large"], "color": _APPAREL_COLORS}, 79.0),
    _t("sandals", "fashion", "women's sandals", f"{_CLOTHING} › women › shoes › sandals",
       ["sandals", "flat sandals", "slide sandals"],
       ["arch support", "non slip", "open toe", "adjustable strap", "rubber sole",
        "cushioned footbed", "vegan leather"],
       {"size": ["us 6", "us 7", "us 8", "us 9", "us 10"], "color": _APPAREL_COLORS}, 32.0),
    _t("backpack", "fashion", "backpack", f"{_CLOTHING} › luggage › backpacks",
       ["backpack", "laptop backpack", "travel backpack"],
       ["water resistant", "usb charging port", "padded laptop sleeve", "anti theft",
        "lightweight", "luggage strap", "reflective strips"],
       {"color": _APPAREL_COLORS}, 38.0),
    # --- furniture --------------------------------------------------------------------
    _t("office chair", "furniture", "office chair", f"{_HOME} › home office › chairs",
       ["office chair", "ergonomic office chair", "mesh office chair"],
       ["lumbar support", "adjustable height", "easy to assemble", "breathable mesh",
        "padded armrests", "swivel base", "heavy duty"],
       {"color": _FURNITURE_COLORS}, 140.0),
    _t("bookshelf", "furniture", "bookshelf", f"{_HOME} › living room › bookcases",
       ["bookshelf", "bookcase", "open bookshelf"],
       ["easy to assemble", "solid wood", "wall mounted", "anti tip", "adjustable shelves",
        "space saving", "engineered wood"],
       {"color": _FURNITURE_COLORS, "size": ["3 tier", "4 tier", "5 tier"]}, 85.0),
    _t("coffee table", "furniture", "coffee table", f"{_HOME} › living room › tables",
       ["coffee table", "wooden coffee table", "round coffee table"],
       ["storage shelf", "easy to assemble", "solid wood", "metal frame", "lift top",
        "scratch resistant", "tempered glass"],
       {"color": _FURNITURE_COLORS}, 120.0),
    _t("bed frame", "furniture", "bed frame", f"{_HOME} › bedroom › beds & frames",
       ["bed frame", "platform bed frame", "metal bed frame"],
       ["no box spring needed", "under bed storage", "easy to assemble", "noise free",
        "heavy duty", "solid wood", "upholstered headboard"],
       {"size": ["twin", "full", "queen", "king"], "color": _FURNITURE_COLORS}, 190.0),
    _t("bar stool", "furniture", "bar stool", f"{_HOME} › dining room › bar stools",
       ["bar stool", "counter height bar stool", "swivel bar stool"],
       ["set of 2", "adjustable height", "footrest", "padded seat", "swivel base",
        "easy to assemble", "back support"],
       {"color": _FURNITURE_COLORS}, 95.0),
    _t("shoe rack", "furniture", "shoe rack", f"{_HOME} › storage & organization › shoe racks",
       ["shoe rack", "shoe organizer", "stackable shoe rack"],
       ["space saving", "easy to assemble", "stackable", "metal frame", "heavy duty",
        "entryway storage", "dust cover"],
       {"color": _FURNITURE_COLORS, "size": ["3 tier", "4 tier", "5 tier"]}, 35.0),
    # --- electronics ------------------------------------------------------------------
    _t("wireless earbuds", "electronics", "wireless earbuds",
       f"{_ELEC} › headphones › earbud headphones",
       ["wireless earbuds", "bluetooth earbuds", "true wireless earbuds"],
       ["noise cancelling", "water resistant", "long battery life", "charging case",
        "built in microphone", "touch control", "fast charging"],
       {"color": _DEVICE_COLORS}, 45.0),
    _t("phone case", "electronics", "phone case", f"{_ELEC} › cell phones & accessories › cases",
       ["phone case", "protective phone case", "slim phone case"],
       ["shockproof", "wireless charging compatible", "raised edges", "screen protector included",
        "anti scratch", "kickstand", "drop tested"],
       {"color": _DEVICE_COLORS, "model": ["iphone 14", "iphone 15 pro", "galaxy s23",
                                           "pixel 8"]}, 15.0),
    _t("desk lamp", "electronics", "led desk lamp", f"{_ELEC} › lighting › desk lamps",
       ["desk lamp", "led desk lamp", "architect desk lamp"],
       ["dimmable", "usb charging port", "eye caring", "touch control", "adjustable arm",
        "auto timer", "energy efficient"],
       {"color": _DEVICE_COLORS}, 33.0),
    _t("power bank", "electronics", "portable charger power bank",
       f"{_ELEC} › cell phones & accessories › chargers › power banks",
       ["power bank", "portable power bank", "slim power bank"],
       ["fast charging", "usb c", "led display", "compact design", "dual output",
        "airline approved", "overcharge protection"],
       {"size": ["10000mah", "20000mah", "26800mah"], "color": _DEVICE_COLORS}, 30.0),
    _t("smart watch", "electronics", "smart watch", f"{_ELEC} › wearable technology › smartwatches",
       ["smart watch", "fitness smart watch", "sport smart watch"],
       ["heart rate monitor", "sleep tracking", "water resistant", "long battery life",
        "gps tracking", "touch screen", "blood oxygen"],
       {"color": _DEVICE_COLORS, "size": ["41mm", "45mm"]}, 110.0),
    _t("bluetooth speaker", "electronics", "bluetooth speaker",
       f"{_ELEC} › portable audio › speakers",
       ["bluetooth speaker", "portable bluetooth speaker", "wireless bluetooth speaker"],
       ["deep bass", "waterproof", "long battery life", "built in microphone", "stereo pairing",
        "shockproof", "compact design"],
       {"color": _DEVICE_COLORS}, 40.0),
)

TYPES_BY_NAME = {t.name: t for t in PRODUCT_TYPES}

# Held out of training goals (test split only): one type per category, so the test split
# measures transfer to unseen product types as well as unseen instruction phrasings.
HELD_OUT_TYPES = ("body lotion", "dark chocolate", "sandals", "shoe rack", "bluetooth speaker")

BRANDS = ("Acme", "Nordly", "Vireo", "Kestrel", "Lumo", "Orchid", "Tandem", "Quill", "Brio",
          "Halcyon", "Zephyr", "Marlow", "Cobalt", "Juniper", "Fable", "Onyx", "Sprig",
          "Pioneer", "Willow", "Ember", "Solace", "Tidewater", "Alder", "Basalt")
TITLE_ADJECTIVES = ("premium", "classic", "everyday", "essential", "deluxe", "signature",
                    "original", "modern", "select", "elite")
TITLE_FORMATS = (
    "{brand} {adj} {noun} - {a1}, {a2}",
    "{brand} {noun} with {a1} and {a2}",
    "{brand} {a1} {noun}, {a2}",
    "{adj} {noun} by {brand} | {a1} | {a2}",
)

def vocabulary_conflicts() -> list[str]:
  """Pairs of vocabulary entries the reward could not tell apart (must be empty)."""
  problems = []
  for ptype in PRODUCT_TYPES:
    groups = [("attribute", list(ptype.attributes), False)]
    groups += [(f"option {k}", list(v), k == "size") for k, v in ptype.options]
    for label, values, exact in groups:
      if len(set(values)) != len(values):
        problems.append(f"{ptype.name}: duplicate {label} values")
      for i, a in enumerate(values):
        for b in values[i + 1:]:
          # Exact-match groups ("size") only need distinct values.
          if not exact and (a in b or b in a):
            problems.append(f"{ptype.name}: {label} {a!r} / {b!r} substring")
          elif not exact and reward.fuzzy_match(reward.normalize_color(a),
                                                reward.normalize_color(b)):
            problems.append(f"{ptype.name}: {label} {a!r} / {b!r} fuzzy-match")
    option_values = [v for _, vals in ptype.options for v in vals]
    if len(set(option_values)) != len(option_values):
      problems.append(f"{ptype.name}: an option value appears in two groups")
  return problems
